"""API keys are deployed hashed, checked against every digest, and named by their tier and name."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from serving.api.admission.keys import KeyRing
from serving.config import ServeConfig
from serving.config.access import hash_key, key_hint


def test_a_plain_key_is_replaced_by_its_salted_digest_when_the_config_loads():
    config = ServeConfig(api_keys=["sk-alice-0123456789"], admin_api_keys=["sk-admin-9876543210"])
    alice, admin = config.keys
    salt_hex, digest_hex = alice.key_sha256.removeprefix("sha256:").split(":")
    assert hashlib.sha256(bytes.fromhex(salt_hex) + b"sk-alice-0123456789").hexdigest() == digest_hex
    assert len(salt_hex) == 32
    assert (alice.name, alice.hint, alice.tier, alice.is_admin) == (f"key-{digest_hex[:8]}", "sk-...6789", "default", False)
    assert admin.is_admin and admin.hint == "sk-...3210"
    dumped = config.model_dump_json()
    assert "sk-alice-0123456789" not in dumped and "sk-admin-9876543210" not in dumped
    # What is deployed validates again to the same keys (no second hashing).
    assert ServeConfig.model_validate_json(dumped).keys == config.keys


def test_the_same_key_gets_another_salt_in_another_config():
    one, two = ServeConfig(api_keys=["sk-same-key-00000000"]), ServeConfig(api_keys=["sk-same-key-00000000"])
    assert one.api_keys[0].key_sha256 != two.api_keys[0].key_sha256


def test_a_key_entry_names_its_tier_and_name():
    config = ServeConfig(
        api_keys=[{"key": "sk-gold-0123456789ab", "name": "team-gold", "tier": "gold"}],
        tiers={"gold": {"requests_per_minute": 600}},
    )
    (gold,) = config.keys
    assert (gold.name, gold.tier, gold.hint) == ("team-gold", "gold", "sk-...89ab")
    assert set(config.tiers) == {"gold", "default"}  # default is always there


@pytest.mark.parametrize(("keys", "tiers", "message"), [
    ([{"key": "sk-k", "tier": "gold"}], {}, "tier 'gold', which `tiers` does not define (defined: default)"),
    ([{"key": "sk-a", "name": "x"}, {"key": "sk-b", "name": "x"}], {}, "names must be unique; x named more than once"),
    ([""], {}, "api_keys[0] is empty"),
    ([{"key": "sk-a", "rate": 1}], {}, "api_keys[0]: unknown rate beside `key`"),
    ([{"name": "x", "key_sha256": "sk-plain-pasted-here"}], {}, "is not `sha256:<salt hex>:<64 hex digits>`"),
    ([], {"t": {"priority": -5, "highest_priority": 0}}, "priority = -5 is more important than highest_priority = 0"),
])
def test_bad_key_and_tier_config_names_the_entry_and_the_fix(keys, tiers, message):
    with pytest.raises(ValidationError) as info:
        ServeConfig(api_keys=keys, tiers=tiers)
    assert message in str(info.value)


def test_the_ring_finds_a_key_by_its_digest_and_nothing_else():
    alice = hash_key("sk-alice-0123456789", name="alice")
    bob = hash_key("sk-bob-0123456789ab", name="bob", tier="gold")
    ring = KeyRing([alice, bob])
    assert ring.check("sk-bob-0123456789ab") == bob
    assert ring.check("sk-bob-0123456789ab") == bob  # remembered
    assert ring.check("sk-alice-0123456789") == alice
    assert ring.check("sk-alice-012345678") is None
    assert ring.check(alice.key_sha256) is None  # the digest is not a key
    assert not KeyRing([])


def test_hints_show_no_more_than_openai_does():
    assert [key_hint(k) for k in ("sk-alice-0123456789", "short-key", "tiny")] == ["sk-...6789", "...ey", "..."]


def test_env_keys_are_hashed_too(monkeypatch):
    from serving.config import load_config

    monkeypatch.setenv("KVRELAY_API_KEYS", "sk-env-one-000000000, sk-env-two-000000000")
    config = load_config(None)
    assert [k.hint for k in config.keys] == ["sk-...0000", "sk-...0000"]
    assert KeyRing(config.keys).check("sk-env-two-000000000") == config.keys[1]


def test_hash_key_prints_an_entry_a_config_accepts(monkeypatch, capsys):
    import io

    import yaml

    from serving.cli.dispatch import main

    monkeypatch.setattr("sys.stdin", io.StringIO("sk-cli-key-0123456789\n"))
    assert main(["hash-key", "--name", "ci", "--tier", "gold"]) == 0
    (entry,) = yaml.safe_load(capsys.readouterr().out)
    assert (entry["name"], entry["tier"], entry["hint"]) == ("ci", "gold", "sk-...6789")
    config = ServeConfig(api_keys=[entry], tiers={"gold": {}})
    assert KeyRing(config.keys).check("sk-cli-key-0123456789").name == "ci"
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["hash-key"]) == 2


def test_an_empty_key_list_never_opens_the_api_where_keys_are_required():
    from serving.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(env={"KVRELAY_REQUIRE_API_KEYS": "true", "KVRELAY_API_KEYS": " , "})
    assert "require_api_keys is true but no api_keys or admin_api_keys are configured" in str(info.value)
    config = load_config(env={"KVRELAY_REQUIRE_API_KEYS": "true", "KVRELAY_ADMIN_API_KEYS": "sk-only-admin-000000"})
    assert [k.is_admin for k in config.keys] == [True]
