// Validates prometheus-operator custom resources (ServiceMonitor, PrometheusRule, ...) against the JSON schemas of
// their monitoring.coreos.com/v1 types, as shipped by @kubernetes-models/prometheus-operator (fetch-chart-tools.sh
// installs it under .tools/crd-schemas).
//
//   node deploy/tools/validate-crs.mjs <crd-schemas dir> < resources.json
//
// stdin: a JSON array of resources. Prints one line per resource; exits 1 when any is invalid or of a kind it has
// no schema for. What it checks: types, required fields, enums and patterns (durations, label names). What it does
// not: unknown fields (the generated schemas allow them; the API server would prune them).
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const schemasDir = process.argv[2];
if (!schemasDir) {
  console.error("usage: validate-crs.mjs <crd-schemas dir> < resources.json");
  process.exit(2);
}
const models = join(schemasDir, "node_modules", "@kubernetes-models", "prometheus-operator", "monitoring.coreos.com");
const resources = JSON.parse(readFileSync(0, "utf8"));
let failed = 0;
for (const resource of resources) {
  const { apiVersion, kind } = resource;
  const name = `${kind}/${resource.metadata?.name}`;
  const [group, version] = (apiVersion ?? "").split("/");
  if (group !== "monitoring.coreos.com") {
    console.log(`FAIL ${name}: ${apiVersion} is not a prometheus-operator API`);
    failed++;
    continue;
  }
  let model;
  try {
    model = (await import(pathToFileURL(join(models, version, `${kind}.js`)).href))[kind];
  } catch (err) {
    console.log(`FAIL ${name}: no schema for ${apiVersion} ${kind} (${err.code ?? err.message})`);
    failed++;
    continue;
  }
  try {
    new model(resource).validate();
    console.log(`ok   ${name} (${apiVersion})`);
  } catch (err) {
    console.log(`FAIL ${name}: ${err.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
