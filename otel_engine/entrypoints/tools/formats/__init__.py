"""The tool formats the engine ships, registered in the order a chat template is matched
against them (the generic format is the fallback, matched by none)."""

from otel_engine.entrypoints.tools.format import register
from otel_engine.entrypoints.tools.formats.generic import GenericFormat
from otel_engine.entrypoints.tools.formats.hermes import HermesFormat
from otel_engine.entrypoints.tools.formats.llama3_json import Llama3JsonFormat
from otel_engine.entrypoints.tools.formats.mistral import MistralFormat
from otel_engine.entrypoints.tools.formats.phi4_mini import Phi4MiniFormat

SHIPPED = (HermesFormat, MistralFormat, Llama3JsonFormat, Phi4MiniFormat, GenericFormat)
for _format in SHIPPED:
    register(_format)
