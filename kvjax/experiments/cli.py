"""The suites' entry-point handler lives in `kvjax.cli` (shared with `kvjax.models.fetch` and `benchmarks.*`)."""

from kvjax.cli import add_compile_cache_flag, debugging, description, run  # noqa: F401
