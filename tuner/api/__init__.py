"""The library API: what every `hgemm-tune` command calls, usable from Python as it is.

    from tuner.api import Options, tune_shape, sweep
    result = tune_shape("4096x4096x8192", Options(trials=200))
    print(result.export["entries"][0]["speedup"])

One `Options` object carries everything a run takes besides what it tunes. Progress goes out
through a `Listener` (the CLI draws bars and tables from it); nothing here prints. Errors in
the input are `tuner.errors.UserError`, raised before any GPU work starts.
"""

from tuner.api.results import (
    Build,
    bench,
    bench_model,
    catalogue_build,
    catalogue_curve,
    catalogue_jobs,
    check_entries,
    check_package,
    export,
    package,
    prebuild,
)
from tuner.api.run import (
    BACKENDS,
    DEFAULT_STORAGE,
    Listener,
    Options,
    SweepResult,
    TuneResult,
    check_family_names,
    families_for,
    make_backend,
    measuring,
    split_list,
)
from tuner.api.tuning import (
    confirm,
    confirm_best,
    join_study,
    nearest_tuned,
    rank_check,
    rank_compare,
    rank_for,
    sweep,
    tune_shape,
)

__all__ = [
    "BACKENDS", "DEFAULT_STORAGE", "Build", "Listener", "Options", "SweepResult", "TuneResult", "bench",
    "bench_model", "check_package", "catalogue_build", "catalogue_curve", "catalogue_jobs", "check_entries",
    "check_family_names",
    "confirm", "confirm_best", "export",
    "families_for", "join_study", "make_backend", "measuring", "nearest_tuned", "package", "prebuild", "rank_check",
    "rank_compare",
    "rank_for", "split_list",
    "sweep", "tune_shape",
]
