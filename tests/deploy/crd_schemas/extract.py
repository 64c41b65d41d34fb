"""Write the JSON schema of one version of a CustomResourceDefinition, as the deploy tests
read it: its `openAPIV3Schema`, descriptions removed (the files stay small).

    python tests/deploy/crd_schemas/extract.py CRD.yaml VERSION > KIND_GROUP_VERSION.json

The CEL rules (`x-kubernetes-validations`) stay in the file but no JSON-schema validator
runs them; the tests check the ones that concern these manifests by hand.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml


def strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main() -> None:
    path, version = sys.argv[1], sys.argv[2]
    with open(path, encoding="utf-8") as file:
        crd = yaml.safe_load(file)
    (found,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = strip(found["schema"]["openAPIV3Schema"])
    json.dump(schema, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
