"""The files a fixture was made from, by SHA-256, recorded in the fixture as `sources`:
tests/fixture_sources.rs fails once one of them changes and the fixture was not made again."""
import hashlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def sources(*paths: str) -> dict:
    """`{path relative to the repository: sha256 hex}` of each of `paths` (repository-relative)."""
    return {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest() for p in paths}
