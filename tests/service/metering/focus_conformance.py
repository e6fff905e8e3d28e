"""FOCUS 1.0 conformance of an export: the FinOps Foundation's `focus-validator` where it is right, and checks of
our own, against the spec's column list, for the rules it gets wrong.

The validator (1.0.0, the last release for Python 3.11) lives in its own venv under `.tools/` (`make tools`; its
pins clash with the project's). Its known bugs:
- four FOCUS 1.0 columns are checked under their 1.0-preview names (InvoiceIssuer, Provider, Publisher,
  ResourceID instead of InvoiceIssuerName, ProviderName, PublisherName, ResourceId), so a conforming file fails
  `<old name>_Required` and the real columns go unchecked;
- `SkuPriceId_Nullable` queries `ChargeType`, renamed ChargeCategory in 1.0, and reports the KeyError as a failure;
- it reads its ISO 4217 list from a path relative to the working directory (it is run from its site-packages);
- it exits 0 whether or not validation failed: the outcome is read from its JUnit XML report.
"""

from __future__ import annotations

import csv
import os
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
VALIDATOR = Path(os.environ.get("GPUQ_FOCUS_VALIDATOR", ROOT / ".tools" / "focus-validator" / "bin" /
                                "focus-validator"))
FOCUS_VERSION = "1.0"

# The FOCUS 1.0 column library, written out from the specification (not imported from the code under test), with
# whether a column may be null.
SPEC_COLUMNS: dict[str, bool] = {
    "AvailabilityZone": True, "BilledCost": False, "BillingAccountId": False, "BillingAccountName": True,
    "BillingCurrency": False, "BillingPeriodEnd": False, "BillingPeriodStart": False, "ChargeCategory": False,
    "ChargeClass": True, "ChargeDescription": True, "ChargeFrequency": False, "ChargePeriodEnd": False,
    "ChargePeriodStart": False, "CommitmentDiscountCategory": True, "CommitmentDiscountId": True,
    "CommitmentDiscountName": True, "CommitmentDiscountStatus": True, "CommitmentDiscountType": True,
    "ConsumedQuantity": True, "ConsumedUnit": True, "ContractedCost": False, "ContractedUnitPrice": True,
    "EffectiveCost": False, "InvoiceIssuerName": False, "ListCost": False, "ListUnitPrice": True,
    "PricingCategory": True, "PricingQuantity": True, "PricingUnit": True, "ProviderName": False,
    "PublisherName": False, "RegionId": True, "RegionName": True, "ResourceId": True, "ResourceName": True,
    "ResourceType": True, "ServiceCategory": False, "ServiceName": False, "SkuId": True, "SkuPriceId": True,
    "SubAccountId": True, "SubAccountName": True, "Tags": True,
}
# Validator checks that fail on a conforming file (see above), each with the rule our own check applies instead.
KNOWN_VALIDATOR_BUGS: dict[str, str] = {
    "InvoiceIssuer_Required": "InvoiceIssuerName present and not null",
    "Provider_Required": "ProviderName present and not null",
    "Publisher_Required": "PublisherName present and not null",
    "ResourceID_Required": "ResourceId present",
    "SkuPriceId_Nullable": "SkuPriceId not null for Usage/Purchase charges that are not corrections",
}


@dataclass(frozen=True)
class ValidatorReport:
    checks: int
    failed: dict[str, str]  # check id -> the validator's message


def run_focus_validator(data_file: Path, report_file: Path) -> ValidatorReport:
    assert VALIDATOR.exists(), f"{VALIDATOR} is missing: run `make tools` (make test does)"
    site_packages = subprocess.run(
        [str(VALIDATOR.with_name("python")), "-c", "import focus_validator, os; "
         "print(os.path.dirname(os.path.dirname(focus_validator.__file__)))"],
        check=True, capture_output=True, text=True).stdout.strip()
    done = subprocess.run([str(VALIDATOR), "--data-file", str(data_file.resolve()), "--validate-version",
                           FOCUS_VERSION, "--output-type", "unittest", "--output-destination",
                           str(report_file.resolve())], cwd=site_packages, capture_output=True, text=True, timeout=300)
    assert report_file.exists(), f"focus-validator wrote no report (exit {done.returncode}):\n{done.stderr}"
    root = ET.parse(report_file).getroot()
    failed = {}
    for case in root.iter("testcase"):
        for failure in case.iter("failure"):
            failed[case.get("name", "").split(" :: ")[0]] = failure.get("message", "")
    return ValidatorReport(checks=int(root.get("tests", "0")), failed=failed)


def own_checks(data_file: Path) -> list[str]:
    """What FOCUS 1.0 requires where the validator is wrong or silent: every column of the spec present, not-null
    columns filled, and the SkuPriceId rule. Returns the problems found."""
    with data_file.open(newline="") as fh:
        reader = csv.DictReader(fh)
        columns = list(reader.fieldnames or ())
        rows = list(reader)
    problems = [f"column {c} is missing" for c in SPEC_COLUMNS if c not in columns]
    problems += [f"column {c} is neither a FOCUS {FOCUS_VERSION} column nor an x_ custom column"
                 for c in columns if c not in SPEC_COLUMNS and not c.startswith("x_")]
    for i, row in enumerate(rows, start=2):
        for column, nullable in SPEC_COLUMNS.items():
            if not nullable and column in row and row[column] == "":
                problems.append(f"line {i}: {column} is null")
        if row.get("ChargeCategory") in ("Usage", "Purchase") and row.get("ChargeClass") != "Correction" \
                and row.get("SkuPriceId", "") == "":
            problems.append(f"line {i}: SkuPriceId is null on a {row['ChargeCategory']} charge")
    return problems
