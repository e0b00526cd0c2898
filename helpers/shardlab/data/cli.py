"""The data layer's command line: ``python -m shardlab.data store`` writes a field store (or finds it written)."""

from __future__ import annotations

import argparse

from .writer import BIG_STORE, field_store, store_dir, write_darcy_store


def main(argv=None) -> None:
    """``python -m shardlab.data store [--big | --darcy] [--out PATH]``: write a store (or find it written)."""
    parser = argparse.ArgumentParser(prog="python -m shardlab.data")
    store = parser.add_subparsers(dest="command", required=True).add_parser("store", help="write a field store")
    which = store.add_mutually_exclusive_group()
    which.add_argument("--big", action="store_true", help=f"{BIG_STORE['height']}² fields instead of CI's small ones")
    which.add_argument("--darcy", action="store_true", help="the Darcy training samples instead of synthetic fields")
    store.add_argument("--out", help=f"where to write it (default: under {store_dir()})")
    args = parser.parse_args(argv)
    path = write_darcy_store(args.out) if args.darcy else field_store(args.big, args.out)
    print(f"{path}: {sum(f.stat().st_size for f in path.rglob('*') if f.is_file()) / 2**20:.1f} MiB")

