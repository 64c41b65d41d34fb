// Parse every LogQL query of the generated dashboards with Grafana's own LogQL grammar
// (@grafana/lezer-logql, what Grafana's Loki editor uses): a query with a syntax error has an
// error node in its tree. Prints one line per bad query and exits 1 if any. Usage:
//   node dashboards/ts/logql.mjs [JSON_DIR]   (default: dashboards/)
//   node dashboards/ts/logql.mjs --query 'QUERY' ...   (parse the given queries instead)
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { parser } from "@grafana/lezer-logql";

const here = path.dirname(fileURLToPath(import.meta.url));

function errorsIn(query) {
  const errors = [];
  parser.parse(query).iterate({
    enter(node) {
      if (node.type.isError) errors.push(node.from);
    },
  });
  return errors;
}

function lokiQueries(board, file) {
  const found = [];
  const panels = (board.panels ?? []).flatMap((p) => [p, ...(p.panels ?? [])]);
  for (const panel of panels) {
    for (const target of panel.targets ?? []) {
      const type = target.datasource?.type ?? panel.datasource?.type;
      if (type === "loki") found.push([`${file} / ${panel.title}`, target.expr]);
    }
  }
  for (const annotation of board.annotations?.list ?? []) {
    if (annotation.datasource?.type === "loki") {
      const expr = annotation.target?.expr ?? annotation.expr;
      found.push([`${file} / annotation ${annotation.name}`, expr]);
    }
  }
  return found;
}

const args = process.argv.slice(2);
let queries;
if (args[0] === "--query") {
  queries = args.slice(1).map((q, i) => [`query ${i}`, q]);
} else {
  const dir = path.resolve(args[0] ?? path.dirname(here));
  queries = fs
    .readdirSync(dir)
    .filter((f) => f.endsWith(".json"))
    .sort()
    .flatMap((f) => lokiQueries(JSON.parse(fs.readFileSync(path.join(dir, f), "utf8")), f));
}
let bad = 0;
for (const [where, query] of queries) {
  const errors = typeof query === "string" && query ? errorsIn(query) : [0];
  if (errors.length) {
    bad += 1;
    console.log(`${where}: LogQL syntax error at ${errors[0]}: ${query}`);
  }
}
console.log(`${queries.length} LogQL queries, ${bad} with errors`);
process.exit(bad ? 1 : 0);
