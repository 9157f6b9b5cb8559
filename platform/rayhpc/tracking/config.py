"""The `tracking:` section every job shares (flags --mlflow, --wandb, --wandb-mode, --log-checkpoint)."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator

from rayhpc.config import ConfigError, StrictModel

INSTALL = {"mlflow": "pip install 'rayhpc[mlflow]'", "wandb": "pip install 'rayhpc[wandb]'"}


class Tracking(StrictModel):
    """Where runs go: MLflow (a tracking URI), W&B (a project), both, or neither (the default)."""

    mlflow: str | None = Field(None, description="log runs to MLflow: a tracking URI (http://HOST:PORT, "
                               "sqlite:///FILE, file:DIR) or 'file' for a store under storage_path (mlruns/)")
    wandb: str | None = Field(None, pattern=r"^[^/\\#?%:]+$", description="log runs to this W&B project")
    wandb_mode: Literal["offline", "online"] = Field("offline", description="W&B: offline writes runs under the "
                                                     "job's folder for `rayhpc sync` to upload from a login node "
                                                     "(compute nodes seldom reach the internet)")
    log_checkpoint: Literal["none", "last", "best"] = Field("none", description="each run's weights as an "
                                                            "artifact: the last, or the kept checkpoint with the "
                                                            "best objective")

    @field_validator("mlflow", "wandb")
    @classmethod
    def _installed(cls, value: str | None, info) -> str | None:
        if value is not None and not installed(info.field_name):
            raise ConfigError(f"needs {info.field_name}, which is not installed: {INSTALL[info.field_name]}")
        return value

    @property
    def enabled(self) -> bool:
        return self.mlflow is not None or self.wandb is not None


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported as absent (sys.modules[module] = None)
        return False
