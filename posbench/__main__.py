"""`python -m posbench [overrides]`: one run, or a sweep with --multirun."""
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import posbench.settings  # noqa: F401  (registers the resolver --help's page reads)
import posbench.gpu_slots  # noqa: F401  (registers ${posbench.gpu_jobs:...}, hydra/launcher=gpus's n_jobs)
from posbench import distributed
from posbench.runner import Refused, run


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        if HydraConfig.get().mode == RunMode.RUN and not str(HydraConfig.get().run.dir).strip():
            raise Refused(ValueError("hydra.run.dir='' would write the run into the current directory; give the "
                                     "run a directory of its own (or leave hydra.run.dir out: results/runs/...)"))
        run(cfg, HydraConfig.get().runtime.output_dir)
    except Refused as err:  # a bad setting: its message, without a traceback of posbench's insides
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise err.original
        sweep = HydraConfig.get().mode == RunMode.MULTIRUN
        job = HydraConfig.get().job.override_dirname if sweep else ""
        print(f"refused{f' ({job})' if job else ''}: {err}", file=sys.stderr)
        if sweep:  # the point's status.json records the refusal (the report lists it); the sweep goes on
            return
        sys.exit(1)


def directory_refusal(argv: list[str]) -> str | None:
    """hydra.run.dir (hydra.sweep.dir with --multirun) given on the command line where a file is, or under
    one: Hydra's own mkdir would fail before main() with a traceback."""
    key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(argv) else "hydra.run.dir"
    given = [arg.split("=", 1)[1] for arg in argv if arg.lstrip("+").startswith(f"{key}=")]
    if not given or "${" in given[-1]:  # the last one counts; an interpolation is Hydra's to resolve
        return None
    path = Path(given[-1].strip("'\""))
    file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if file is None:
        return None
    return f"{key}={path}: {file} is a file, not a directory; choose another {key}"


if __name__ == "__main__":
    refusal = directory_refusal(sys.argv[1:])
    if refusal:
        print(f"refused: {refusal}", file=sys.stderr)
        sys.exit(1)
    try:
        main()
    except SystemExit as request:
        distributed.leave(request.code)
        raise
    distributed.leave(0)
