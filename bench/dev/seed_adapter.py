"""Check and time the seed kernel beside the project's backends with ``leapquant bench``.

The seed kernel (the design reference of this project: a warp-specialised TileLang flush, used from the seed document's
readable copy ``seed_kernel_formatted.py`` and never copied into this repository) has an interface of its own:
``Pool(num_slots, device)`` with a fixed head count and gate, its Compensator Tokens named ``uq``, and
``flush_inplace(pool, idx, q0)``. ``leapquant bench --impl MODULE.py`` takes modules with the project's interface
(``Pool(num_slots, num_heads=H, device=D, gate=G)`` with ``leapquant.Pool``'s attributes, ``flush_inplace``). This
module is such a module, wrapping the seed file named by the environment variable ``LEAPQUANT_SEED_KERNEL``:

    python bench/dev/seed_adapter.py /path/to/seed_kernel_formatted.py [leapquant bench options]
    LEAPQUANT_SEED_KERNEL=/path/to/seed_kernel_formatted.py leapquant bench --impl bench/dev/seed_adapter.py [...]

Both run the same thing (the first sets the variable and adds ``--impl`` with this file). The seed's rows are named
``impl:<the seed file's stem>`` (``impl:seed_kernel_formatted``). Building one of the seed's pools compiles its kernel
(needs tilelang 0.1.12 and nvcc), so the pool built last is kept for the next gate and freed by ``close()``, which the
bench calls once the seed's rows are done. A pool the seed cannot give (another head count, the GDN gate) raises a
``ValueError`` that becomes the rows' verdict.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "LEAPQUANT_SEED_KERNEL"


def load_seed(path: str | os.PathLike):
    """Import the seed file at ``path`` as a module of its own and check that it has ``Pool`` and ``flush_inplace``."""
    from leapquant.bench import load_module
    return load_module(str(path), f"{ENV}=", ("Pool", "flush_inplace"),
                       "Pool(num_slots, device), flush_inplace(pool, idx, q0)")


def seed_gate(pool) -> str:
    """The gate a seed pool serves: KDA when it holds the per-key gates (``pcum`` and ``gbuf``), else GDN."""
    return "kda" if getattr(pool, "pcum", None) is not None and getattr(pool, "gbuf", None) is not None else "gdn"


_built: dict = {}                                # (num_slots, device) -> the seed's pool built last


class Pool:
    """One of the seed's pools seen through ``leapquant.Pool``'s attributes: every attribute is the seed pool's own
    tensor (no copy); ``tokens`` is its ``uq`` when it has no ``tokens``."""

    def __init__(self, num_slots: int, num_heads: int = 32, device=None, gate: str = "kda") -> None:
        key = (num_slots, str(device))
        if key not in _built:
            _built.clear()                       # one seed pool at a time: each holds a compiled kernel
            _built[key] = _SEED.Pool(num_slots, device)
        inner = _built[key]
        heads = int(inner.codes.shape[1])
        if heads != num_heads:
            raise ValueError(f"the module's Pool has {heads} heads, the run asks for {num_heads} (--heads)")
        if seed_gate(inner) != gate:
            raise ValueError(f"the module's Pool is {seed_gate(inner)}, the run asks for gate {gate}")
        self.__dict__["inner"] = inner

    def __getattr__(self, name: str):
        inner = self.__dict__["inner"]
        if name == "tokens" and getattr(inner, "tokens", None) is None:
            return inner.uq
        return getattr(inner, name)


def flush_inplace(pool: Pool, idx, q0) -> None:
    """The seed's flush on the seed pool inside ``pool``."""
    _SEED.flush_inplace(pool.inner, idx, q0)


def close() -> None:
    """Free the seed pool kept for the next gate."""
    _built.clear()


def main(argv: list[str] | None = None) -> int:
    """``python bench/dev/seed_adapter.py SEED.py [leapquant bench options]``: the bench with the seed beside the
    backends."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python bench/dev/seed_adapter.py SEED.py [leapquant bench options]\n\n" + __doc__,
              file=sys.stderr)
        return 2
    os.environ[ENV] = str(Path(argv[0]).expanduser().resolve())
    from leapquant import bench
    return bench.main([*argv[1:], "--impl", str(Path(__file__).resolve())])


if __name__ == "__main__":
    sys.exit(main())

# imported by the bench (--impl): the seed file named by the environment
if not os.environ.get(ENV):
    raise ImportError(f"set {ENV} to the seed kernel's file (or run python bench/dev/seed_adapter.py SEED.py ...)")
_SEED = load_seed(os.environ[ENV])
NAME = Path(os.environ[ENV]).stem                # rows named impl:<stem>, as in bench/results/history.csv
