"""The cost model and its hardware profiles (see `costmodels/` for the bundled ones)."""

from autopar.cost.model import PRECISIONS, CostModel, Precision
from autopar.cost.profile import HardwareProfile, LinkLevel, Sourced, available_profiles, load_profile

__all__ = [
    "PRECISIONS",
    "CostModel",
    "HardwareProfile",
    "LinkLevel",
    "Precision",
    "Sourced",
    "available_profiles",
    "load_profile",
]
