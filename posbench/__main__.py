"""`python -m posbench [overrides]`: one run, or a sweep with --multirun."""
import os
import sys

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


if __name__ == "__main__":
    try:
        main()
    except SystemExit as request:
        distributed.leave(request.code)
        raise
    distributed.leave(0)
