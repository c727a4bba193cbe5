"""Per-kind table of a storage's trials: what failed, how often, and one reason each.

    python benchmarks/failure_table.py STORAGE [--by kind|gpu]
"""

from __future__ import annotations

import argparse
import collections

from tuner.export import load_studies, trial_rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("storage")
    ap.add_argument("--by", choices=("kind", "gpu"), default="kind")
    args = ap.parse_args()
    for study in load_studies(args.storage):
        rows = [r for r in trial_rows(study) if r.get("status") not in (None, "invalid", "duplicate", "surplus")]
        groups: dict[str, list[dict]] = collections.defaultdict(list)
        for r in rows:
            key = (r.get("kind") or r["status"]) if args.by == "kind" else r.get("gpu", "?")
            groups[key].append(r)
        print(f"\n{study.study_name}: {len(rows)} measured trials")
        print(f"| {args.by} | trials | families | example reason |\n|---|---:|---|---|")
        for key, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            fams = ",".join(sorted({r["family"] for r in items}))
            reason = next((r.get("reason") for r in items if r.get("reason")), "") or ""
            print(f"| {key} | {len(items)} | {fams} | {reason[:110].replace('|', '/')} |")


if __name__ == "__main__":
    main()
