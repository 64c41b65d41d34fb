// Strict TypeScript check of the generated dashboards against @grafana/schema.
//
// For each ../*.json this writes a .ts module that assigns the dashboard, and each panel's
// options, field config and Loki targets, to their @grafana/schema types as object literals,
// so tsc's excess-property and literal checks catch unknown keys and wrong values. String
// enums are compared by value (JSON cannot name an enum member). Usage:
//   node dashboards/ts/check.mjs [OUT_DIR [JSON_DIR]]
// exits with tsc's status; OUT_DIR defaults to a new temp dir, JSON_DIR to dashboards/.
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const modules = path.join(here, "node_modules");
const outDir = path.resolve(
  process.argv[2] ?? fs.mkdtempSync(path.join(os.tmpdir(), "dashboards-ts-")),
);
const jsonDir = path.resolve(process.argv[3] ?? path.dirname(here));
const raw = "@grafana/schema/dist/types/raw/composable";
// panel type -> [module with its Options / FieldConfig, has a FieldConfig type]
const PANELS = {
  timeseries: ["timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen", true],
  stat: ["stat/panelcfg/x/StatPanelCfg_types.gen", false],
  "state-timeline": ["statetimeline/panelcfg/x/StateTimelinePanelCfg_types.gen", true],
  logs: ["logs/panelcfg/x/LogsPanelCfg_types.gen", false],
};

const header = [
  'import type { AnnotationQuery, Dashboard, DataQuery } from "@grafana/schema";',
  `import type { LokiDataQuery } from "${raw}/loki/dataquery/x/LokiDataQuery_types.gen";`,
  ...Object.entries(PANELS).map(
    ([type, [module]], i) => `import type * as P${i} from "${raw}/${module}";`,
  ),
  "type Json<T> = T extends string ? `${T}` : T extends (infer U)[] ? Json<U>[]",
  "  : T extends object ? { [K in keyof T]: Json<T[K]> } : T;",
  // @grafana/schema has no Prometheus query type, nor the annotation fields the Prometheus
  // plugin reads (titleFormat, textFormat, tagKeys): these few are declared here.
  "interface PromQuery extends DataQuery { expr: string; interval?: string }",
  "type Annotation = AnnotationQuery<PromQuery | LokiDataQuery>",
  "  & { titleFormat?: string; textFormat?: string; tagKeys?: string };",
  "type Board = Omit<Dashboard, 'annotations'> & { annotations?: { list?: Annotation[] } };",
  "",
];

function panelsOf(board) {
  return (board.panels ?? []).flatMap((p) => [p, ...(p.panels ?? [])]);
}

function moduleFor(board) {
  const lines = [...header, `export const dashboard: Json<Board> = ${JSON.stringify(board)};`];
  for (const panel of panelsOf(board)) {
    if (panel.type === "row") continue;
    const index = Object.keys(PANELS).indexOf(panel.type);
    if (index < 0) throw new Error(`no schema for panel type ${panel.type} (${panel.title})`);
    const name = `panel${panel.id}`;
    lines.push(`export const ${name}Options: Json<P${index}.Options> = ${JSON.stringify(panel.options ?? {})};`);
    if (PANELS[panel.type][1]) {
      const custom = panel.fieldConfig?.defaults?.custom ?? {};
      lines.push(`export const ${name}Custom: Json<P${index}.FieldConfig> = ${JSON.stringify(custom)};`);
    }
    for (const target of panel.targets ?? []) {
      if (target.datasource?.type === "loki") {
        lines.push(`export const ${name}${target.refId}: Json<LokiDataQuery> = ${JSON.stringify(target)};`);
      }
    }
  }
  return lines.join("\n") + "\n";
}

fs.mkdirSync(outDir, { recursive: true });
const files = [];
for (const file of fs.readdirSync(jsonDir).sort()) {
  if (!file.endsWith(".json")) continue;
  const board = JSON.parse(fs.readFileSync(path.join(jsonDir, file), "utf8"));
  const ts = path.join(outDir, file.replace(/\.json$/, ".ts"));
  fs.writeFileSync(ts, moduleFor(board));
  files.push(ts);
}
if (files.length === 0) throw new Error("no dashboards/*.json to check");
const link = path.join(outDir, "node_modules");
if (!fs.existsSync(link)) fs.symlinkSync(modules, link, "dir");
fs.writeFileSync(
  path.join(outDir, "tsconfig.json"),
  JSON.stringify({
    compilerOptions: {
      strict: true,
      noEmit: true,
      target: "es2022",
      module: "commonjs",
      moduleResolution: "node10",
      skipLibCheck: true,
      types: [],
    },
    files: files.map((f) => path.basename(f)),
  }),
);
const tsc = path.join(modules, "typescript", "bin", "tsc");
try {
  execFileSync(process.execPath, [tsc, "-p", outDir], { stdio: "inherit" });
  console.log(`ok: ${files.length} dashboards match @grafana/schema`);
} catch (error) {
  process.exit(error.status ?? 1);
}
