"""The engine seams a plugin hooks: a missing one fails start-up naming it and the engine's version; an
unknown
version logs what was found. SGLang's plugin against a stand-in SGLang (its modules as empty shells holding
exactly the plugin's seams, one taken away at a time); vLLM's against real vLLM:
tests/engines/test_vllm_seam.py.
"""

import enum
import logging
import sys
import types

import pytest

from tpfuse.engines import seams, sglang
from tpfuse.engines.seams import Seam, SeamMissing, StartUpStopped


def _stand_in_sglang(monkeypatch, version: str, without: str | None = None) -> list:
    """Install modules named as SGLang's holding every target of ``sglang.SEAMS`` (but ``without``);
    returns the list the stand-in ``HookRegistry.register`` appends its calls to."""
    registered = []

    class HookType(enum.Enum):
        REPLACE = "replace"

    class HookRegistry:
        @staticmethod
        def register(target, hook, kind):
            registered.append((target, hook, kind))

    class BaseRunner:
        def _pre_initialize_flashinfer_allreduce_workspace(self):
            pass

    values = {"HookRegistry": HookRegistry, "HookType": HookType, "BaseRunner": BaseRunner}
    for seam in sglang.SEAMS:
        module_name, _, attributes = seam.target.partition(":")
        top = attributes.split(".")[0]
        for depth in range(1, module_name.count(".") + 2):
            name = ".".join(module_name.split(".")[:depth])
            if name not in sys.modules or not getattr(sys.modules[name], "_stand_in", False):
                module = types.ModuleType(name)
                module._stand_in = True
                monkeypatch.setitem(sys.modules, name, module)
        setattr(sys.modules[module_name], top, values.get(top, lambda *args, **kwargs: None))
    sys.modules["sglang"].__version__ = version
    if without is not None:
        module_name, _, attributes = without.partition(":")
        owner = sys.modules[module_name]
        *path, last = attributes.split(".")
        for attribute in path:
            owner = getattr(owner, attribute)
        if isinstance(owner, type) and issubclass(owner, enum.Enum):
            monkeypatch.setattr(sys.modules[module_name], path[-1], enum.Enum(path[-1], {"OTHER": 1}))
        else:
            monkeypatch.delattr(owner, last)
    return registered


@pytest.mark.parametrize("missing", [seam.target for seam in sglang.SEAMS])
def test_sglang_plugin_fails_start_up_naming_a_missing_seam(monkeypatch, missing):
    registered = _stand_in_sglang(monkeypatch, "0.5.24", without=missing)
    monkeypatch.setenv(sglang.ENV, "1")
    # A SystemExit (SGLang's load_plugins would log and swallow an Exception, starting without tpfuse),
    # from the SeamMissing that names the seam
    with pytest.raises(StartUpStopped) as raised:
        sglang.register()
    assert isinstance(raised.value.__cause__, SeamMissing) and isinstance(raised.value, SystemExit)
    message = str(raised.value)
    assert missing in message and "SGLang 0.5.24" in message and "0.5.23" in message, message
    assert registered == []  # nothing hooked when something is missing


def test_sglang_plugin_hooks_all_three_where_every_seam_is_there(monkeypatch, caplog):
    registered = _stand_in_sglang(monkeypatch, "0.5.23")
    monkeypatch.setenv(sglang.ENV, "1")
    with caplog.at_level(logging.INFO, logger="tpfuse"):
        sglang.register()
    assert [target for target, _, _ in registered] == [sglang.FUSED_CALL, sglang.GATE, sglang.WORKSPACE]
    assert [hook for _, hook, _ in registered] == [sglang.allreduce_residual_rmsnorm, sglang.fusion_applies,
                                                   sglang.create_communicators]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # a known version: nothing to say


def test_sglang_plugin_on_another_version_logs_the_seams_it_found(monkeypatch, caplog):
    _stand_in_sglang(monkeypatch, "0.6.1")
    monkeypatch.setenv(sglang.ENV, "1")
    with caplog.at_level(logging.WARNING, logger="tpfuse"):
        sglang.register()
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = record.getMessage()
    assert "SGLang 0.6.1" in text and all(seam.target in text for seam in sglang.SEAMS), text


def test_sglang_plugin_without_its_switch_touches_nothing(monkeypatch):
    monkeypatch.delenv(sglang.ENV, raising=False)
    monkeypatch.setitem(sys.modules, "sglang", None)  # not even importable: the plugin must not look
    sglang.register()


def test_an_optional_seam_that_is_missing_is_said_and_skipped(monkeypatch, caplog):
    module = types.ModuleType("tpfuse_test_engine")
    module.__version__ = "1.0"
    module.present = lambda: None
    monkeypatch.setitem(sys.modules, "tpfuse_test_engine", module)
    wanted = (Seam("tpfuse_test_engine:present", "uses it"),
              Seam("tpfuse_test_engine:newer_helper", "uses it too", required=False))
    with caplog.at_level(logging.INFO, logger="tpfuse"):
        found = seams.check("Engine", "1.0", wanted, ("1.0",), ("1.0",), logging.getLogger("tpfuse.test"))
    assert list(found) == ["tpfuse_test_engine:present"]
    assert any("newer_helper" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    with pytest.raises(SeamMissing, match=r"(?s)Engine 2\.0.*tpfuse_test_engine:gone"):
        seams.check("Engine", "2.0", wanted
                    + (Seam("tpfuse_test_engine:gone", "needs it"),), ("1.0",), ("1.0",),
                    logging.getLogger("tpfuse.test"))


def test_a_module_that_does_not_import_is_a_missing_seam():
    with pytest.raises(LookupError, match="does not import"):
        seams.resolve("tpfuse_no_such_engine.module:thing")
    assert seams.base_version("0.32.0+cpu") == "0.32.0"
