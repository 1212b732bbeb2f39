"""Bundled hardware profiles (TOML, every number with its source). See `autopar.cost.load_profile`."""
