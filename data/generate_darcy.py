"""Generate data/darcy2d.npz: 2-D Darcy flow samples, permeability -> pressure, from a fixed seed.

Solves -div(k grad p) = f on the unit square, f = 1, p = 0 on the boundary, on an S x S node grid
(boundary nodes included, h = 1/(S-1)) with a 5-point finite-volume stencil whose face permeabilities
are harmonic means of the two neighbouring nodes. The linear system is solved per sample by
Jacobi-preconditioned conjugate gradient in float64; arrays are stored as float32.

Permeability follows the FNO Darcy benchmark: a Gaussian random field with covariance
(-Laplacian + tau^2)^(-alpha), tau = 3, alpha = 2, mean mode removed, thresholded at 0 to 12 / 3.

    python data/generate_darcy.py [--out data/darcy2d.npz] [--samples 256] [--size 64] [--seed 0]

Only numpy is needed. See data/README.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

K_LOW, K_HIGH = 3.0, 12.0
TAU, ALPHA = 3.0, 2.0
FORCING = 1.0
CG_RTOL = 1e-10
DEFAULT_OUT = Path(__file__).resolve().parent / "darcy2d.npz"


def random_permeability(rng: np.random.Generator, size: int) -> np.ndarray:
    """One thresholded Gaussian random field, values K_LOW / K_HIGH, shape (size, size), float64."""
    freq = np.fft.fftfreq(size, d=1.0 / size)
    kx, ky = np.meshgrid(freq, freq, indexing="ij")
    sqrt_eig = (4.0 * np.pi**2 * (kx**2 + ky**2) + TAU**2) ** (-ALPHA / 2.0)
    sqrt_eig[0, 0] = 0.0  # no mean mode, so the threshold at 0 splits each field into both values
    field = np.fft.ifft2(sqrt_eig * np.fft.fft2(rng.standard_normal((size, size)))).real
    return np.where(field >= 0.0, K_HIGH, K_LOW)


def face_permeabilities(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Harmonic means on the faces along axis 0, shape (S-1, S), and along axis 1, shape (S, S-1)."""
    k0 = 2.0 * k[1:, :] * k[:-1, :] / (k[1:, :] + k[:-1, :])
    k1 = 2.0 * k[:, 1:] * k[:, :-1] / (k[:, 1:] + k[:, :-1])
    return k0, k1


def darcy_operator(p: np.ndarray, k0: np.ndarray, k1: np.ndarray, h: float) -> np.ndarray:
    """-div(k grad p) at the interior nodes, shape (S-2, S-2); p is the full (S, S) grid."""
    flux0 = k0 * (p[1:, :] - p[:-1, :])
    flux1 = k1 * (p[:, 1:] - p[:, :-1])
    div = (flux0[1:, :] - flux0[:-1, :])[:, 1:-1] + (flux1[:, 1:] - flux1[:, :-1])[1:-1, :]
    return -div / h**2


def solve_pressure(k: np.ndarray, h: float, forcing: float = FORCING, rtol: float = CG_RTOL) -> np.ndarray:
    """Pressure on the full grid (zero boundary) for one permeability field, by preconditioned CG."""
    k0, k1 = face_permeabilities(k)
    diag = (k0[1:, 1:-1] + k0[:-1, 1:-1] + k1[1:-1, 1:] + k1[1:-1, :-1]) / h**2
    p = np.zeros_like(k)  # boundary rows/columns stay zero: the Dirichlet condition
    direction = np.zeros_like(k)
    r = np.full(diag.shape, forcing)
    z = r / diag
    direction[1:-1, 1:-1] = z
    rz = np.vdot(r, z)
    stop = rtol * np.linalg.norm(r)
    for _ in range(10 * r.size):  # CG converges in far fewer; the cap only guards against a bug
        ad = darcy_operator(direction, k0, k1, h)
        step = rz / np.vdot(direction[1:-1, 1:-1], ad)
        p[1:-1, 1:-1] += step * direction[1:-1, 1:-1]
        r -= step * ad
        if np.linalg.norm(r) < stop:
            return p
        z = r / diag
        rz, rz_old = np.vdot(r, z), rz
        direction[1:-1, 1:-1] = z + (rz / rz_old) * direction[1:-1, 1:-1]
    raise RuntimeError("conjugate gradient did not converge")


def generate(samples: int = 256, size: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    """The dataset as a dict of arrays; the first n samples do not depend on `samples` (one RNG stream)."""
    if samples < 1 or size < 3:
        raise ValueError(f"need samples >= 1 and size >= 3, got samples={samples}, size={size}")
    rng = np.random.default_rng(seed)
    h = 1.0 / (size - 1)
    perm = np.empty((samples, size, size), dtype=np.float32)
    pres = np.empty((samples, size, size), dtype=np.float32)
    for i in range(samples):
        k = random_permeability(rng, size)
        perm[i] = k
        pres[i] = solve_pressure(k, h)
    return {
        "permeability": perm,
        "pressure": pres,
        "seed": np.array(seed, dtype=np.int64),
        "grid_spacing": np.array(h, dtype=np.float64),
        "forcing": np.array(FORCING, dtype=np.float64),
        "permeability_values": np.array([K_LOW, K_HIGH], dtype=np.float64),
        "cg_rtol": np.array(CG_RTOL, dtype=np.float64),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output .npz (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=256, help="number of samples (default: %(default)s)")
    parser.add_argument("--size", type=int, default=64, help="grid nodes per side (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    arrays = generate(args.samples, args.size, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    elapsed = time.perf_counter() - t0
    shape = arrays["pressure"].shape
    print(f"wrote {args.out}: permeability, pressure {shape} float32, seed {args.seed}, "
          f"{args.out.stat().st_size / 1e6:.2f} MB in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
