"""`python -m posbench [overrides]`: one run, or a sweep with --multirun."""
import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import posbench.settings  # noqa: F401  (registers the resolver --help's page reads)
from posbench.runner import run


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
