from __future__ import annotations

import pytest

from rlhf.core.plugin_host.fingerprint import fingerprint_differences, plugin_fingerprint
from rlhf.core.plugin_host.loading import build_plugin_manager

pytestmark = pytest.mark.unit


def test_fingerprint_lists_loaded_plugins_with_versions(fake_site):
    fake_site.add("rlhf-fp", "1.4", {"fp": "rlhf_fp_mod"}, {"rlhf_fp_mod": "x = 1\n"})
    fake_site.add("rlhf-fp-broken", "0.1", {"fp_broken": "rlhf_fp_broken_mod"}, {"rlhf_fp_broken_mod": "1/0\n"})
    fingerprint = plugin_fingerprint(build_plugin_manager(builtins=["tests.core.sample_plugin"]))
    assert fingerprint["plugins"]["fp"] == "rlhf-fp==1.4"
    assert fingerprint["plugins"]["tests.core.sample_plugin"].startswith("rlhf-core==")
    assert "fp_broken" not in fingerprint["plugins"]
    assert len(fingerprint["hash"]) == 16


def test_fingerprint_is_stable_and_differences_name_the_plugin(fake_site):
    fake_site.add("rlhf-fp2", "2.0", {"fp2": "rlhf_fp2_mod"}, {"rlhf_fp2_mod": "x = 1\n"})
    first = plugin_fingerprint(build_plugin_manager())
    assert plugin_fingerprint(build_plugin_manager()) == first
    assert fingerprint_differences(first, first) == []

    worker = {"plugins": {**first["plugins"], "fp2": "rlhf-fp2==2.1", "extra": "rlhf-x==1"}, "hash": "x"}
    assert fingerprint_differences(first, worker) == [
        "plugin 'extra' (rlhf-x==1) is extra",
        "plugin 'fp2' is rlhf-fp2==2.1, expected rlhf-fp2==2.0",
    ]
    missing = {"plugins": {k: v for k, v in first["plugins"].items() if k != "fp2"}, "hash": "y"}
    assert fingerprint_differences(first, missing) == ["plugin 'fp2' (rlhf-fp2==2.0) is missing"]
