"""Collection for the doctests under ``autopar/``: a module that needs an optional package not installed here
is not imported (the compiled kernels need numba, `autopar.search.native`)."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("numba") else ["autopar/search/native_jit.py"]
