"""The device check's one table: each figure the stages of scripts/device_checks.sh printed as JSON lines, beside
what it is measured against in the same run and its target (jaxpage.benchmarks.device_table says which).

    python scripts/device_table.py OUT_DIR/*.log       # exit status 1 when a target is missed or has no figure
"""

from __future__ import annotations

import argparse
import sys

from jaxpage.benchmarks.device_table import failed, format_table, read_records, table_rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="*", help="the stages' logs (lines that are not JSON records are skipped)")
    args = parser.parse_args()
    records = read_records(args.logs)
    rows = table_rows(records)
    print(format_table(rows, records))
    return 1 if failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
