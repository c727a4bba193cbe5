"""Compile, on a machine without a GPU, the kernels the GPU test suite builds, into the compile
cache ($HGEMM_TUNE_CACHE), so a device call spends its minutes timing rather than in nvcc:

    HGEMM_TUNE_CACHE=/tmp/cubins python scripts/prebuild_gpu_tests.py
    tar cJf runs/cubins.tar.xz -C /tmp/cubins .      # carried by scripts/device_run.sh

It mirrors the configs of tests/test_gpu.py, tests/test_benchmark.py and tests/test_proposer.py
(family defaults, the explicit cute_sm90 configs, the first seeds of the short studies). A
kernel it misses is only compiled on the device; nothing here changes what a test checks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tuner.build import compile_source, render
from tuner.search.sampler import full_config, seed_configs
from tuner.space import load_space, parse_shape
from tuner.space.target import target_for_arch

ARCH = "sm_90a"
ROOT = Path(__file__).resolve().parent.parent
SEEDS_PER_STUDY = 5  # the GPU tests tune 2-4 trials; one spare


def jobs() -> list[tuple[str, str, str]]:
    space = load_space(ROOT / "space.yaml")
    target = target_for_arch(ARCH)
    out: list[tuple[str, str, str]] = []

    def add(label: str, family: str, full: dict, accumulate: str = "fp32") -> None:
        fam = space.family(family)
        out.append((label, render(fam, full, ARCH, accumulate=accumulate), fam.artifact))

    for family in ("cute_sm80", "wmma", "cute_sm90"):  # test_family_defaults_verify_on_tails
        fam = space.family(family)
        config = fam.compile_config(fam.defaults())
        add(f"{family} defaults", family, full_config(fam, config))
        for shape_s in ("1x8x8", "127x136x72"):
            if fam.violations(fam.complete(config), parse_shape(shape_s), target):
                add(f"{family} defaults, CLUSTER_M=1", family, full_config(fam, config | {"CLUSTER_M": 1}))
                break
    sm90 = space.family("cute_sm90")
    add("cute_sm90 fp16 accumulate", "cute_sm90", full_config(sm90, sm90.compile_config(sm90.defaults())), "fp16")
    explicit = [
        {"TILE_N": 64, "SCHEDULER": "streamk", "STAGES": 8, "CLUSTER_M": 1},
        {"TILE_N": 64, "STAGES": 6, "CLUSTER_M": 2, "CLUSTER_N": 2, "L2_HINT": "stream_b", "TMA_L2_PROMOTION": 256},
        *({"TILE_N": 64, "STAGES": 6, "CLUSTER_M": cm, "CLUSTER_N": cn, "SCHEDULER": "persistent",
           "PROLOGUE": "early_load"} for cm, cn in ((1, 1), (2, 1), (1, 2))),
    ]
    for cfg in explicit:
        # Tests that go through prepare() render full_config(compile config); the others render complete(cfg).
        add(f"cute_sm90 {cfg}", "cute_sm90", full_config(sm90, sm90.compile_config(sm90.complete(cfg))))
        add(f"cute_sm90 {cfg} (as given)", "cute_sm90", sm90.complete(cfg))
    basic = next(s for s in sm90.seeds if s.get("SCHEDULE") == "basic")  # test_cute_sm90_basic_schedule_...
    add(f"cute_sm90 {basic}", "cute_sm90", full_config(sm90, sm90.compile_config(sm90.complete(basic))))
    for tile in ({"TILE_M": 64, "TILE_N": 64, "STAGES": 6}, {"TILE_M": 128, "TILE_N": 128, "STAGES": 3}):
        split = {**tile, "SCHEDULE": "basic", "CLUSTER_M": 1}  # test_cute_sm90_basic_split_k_*
        add(f"cute_sm90 {split}", "cute_sm90", full_config(sm90, sm90.compile_config(sm90.complete(split))))
        add(f"cute_sm90 {split} (as given)", "cute_sm90", sm90.complete(split))
    # The seeds the tests' short studies try first (tune(..., trials=2-4) on these shapes).
    for shape_s in ("512x384x256", "1001x520x336"):
        shape = parse_shape(shape_s)
        for family in ("wmma", "cute_sm90"):
            fam = space.family(family)
            valid = [c for c in seed_configs(fam, shape) if not fam.violations(full_config(fam, c), shape, target)]
            for cfg in valid[:SEEDS_PER_STUDY]:
                add(f"{family} seed {cfg} of {shape_s}", family, full_config(fam, cfg))
    # Dedupe by source: the (as given) and compile-config forms often render the same kernel.
    seen: dict[str, tuple[str, str, str]] = {}
    for job in out:
        seen.setdefault(job[1], job)
    return list(seen.values())


def main() -> int:
    todo = jobs()
    print(f"{len(todo)} kernels from the test configs", flush=True)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda j: (j[0], compile_source(j[1], ARCH, artifact=j[2])), todo))
    bad = [(label, r.error) for label, r in results if not r.ok]
    for label, err in bad:
        print(f"FAILED {label}: {str(err)[:300]}")
    print(f"{len(results) - len(bad)} built, {len(bad)} failed", flush=True)
    return 1 if bad else 0

if __name__ == "__main__":
    raise SystemExit(main())
