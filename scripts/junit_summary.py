"""Sum the stages' JUnit XML files into one closing line: ``N passed, N failed, N skipped``.

Usage: ``python scripts/junit_summary.py LOGDIR/*.xml`` (scripts/test.sh runs it last). A stage whose
file is missing (it did not run, or crashed before writing it) is listed as such and counts as failed.
"""

import os
import sys
import xml.etree.ElementTree as ET


def counts(path: str) -> dict[str, int]:
  """passed / failed / skipped of one pytest JUnit file (errors count as failed)."""
  root = ET.parse(path).getroot()
  suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
  tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
  for s in suites:
    for k in tot:
      tot[k] += int(s.get(k, 0))
  failed = tot["failures"] + tot["errors"]
  return {"passed": tot["tests"] - failed - tot["skipped"], "failed": failed, "skipped": tot["skipped"]}


def main(paths: list[str]) -> int:
  total = {"passed": 0, "failed": 0, "skipped": 0}
  for p in paths:
    name = os.path.splitext(os.path.basename(p))[0]
    if not os.path.exists(p):
      print(f"  {name:8s} no result file (the stage did not finish)")
      total["failed"] += 1
      continue
    c = counts(p)
    print(f"  {name:8s} {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
    for k in total:
      total[k] += c[k]
  print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
