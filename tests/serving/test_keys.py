"""Page keys: content-addressed, fingerprinted, rank-agnostic for MLA."""

from kvhelper.keys import block_key


def test_keys() -> None:
    digest = bytes(range(32))
    mla = block_key("f" * 16, digest)
    assert mla == f"kvh1/{'f' * 16}/{digest.hex()}"
    assert block_key("f" * 16, digest, (2, 1)) == mla + "/tp2r1"
    assert block_key("a" * 16, digest) != mla  # incompatible instances never share a key
