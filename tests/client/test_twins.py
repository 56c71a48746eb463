"""Each blocking client class and its asyncio twin have the same public methods with the same
signatures (ignoring async-ness), so a misspelt option is a type error in both and neither drifts.

Strategy (docs/architecture.md, "The vocabulary"): the stateful blocking classes (producers, consumers, processors,
sources) wrap their async twin, run on the client's background loop, and spell out its
parameters; the stream handles are two thin shells over the same sans-I/O helpers. Either way this
test is what keeps a pair in step (httpx checks its generated sync twin the same way).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

from onceflow.client import (
    AsyncConsumer,
    AsyncIdempotentProducer,
    AsyncStream,
    AsyncTransactionalProducer,
    Consumer,
    IdempotentProducer,
    Stream,
    TransactionalProducer,
)
from onceflow.processors import (
    AsyncSinkProcessor,
    AsyncSource,
    AsyncStreamProcessor,
    SinkProcessor,
    Source,
    StreamProcessor,
)

# (async class, blocking class, what only the async one has and why)
PAIRS: list[tuple[type, type, dict[str, str]]] = [
    (AsyncStream, Stream, {}),
    (AsyncIdempotentProducer, IdempotentProducer, {"start": "the blocking twin starts in its constructor"}),
    (
        AsyncTransactionalProducer,
        TransactionalProducer,
        {
            "resume": "for the Spark connector's writers, whose epochs the sink's begin issues; the blocking twin init()s in its constructor",
        },
    ),
    (
        AsyncConsumer,
        Consumer,
        {
            "start": "the blocking twin starts in its constructor",
            "hold_back": "the blocking twin's commit() holds back the messages it has not handed out itself",
        },
    ),
    (AsyncStreamProcessor, StreamProcessor, {}),
    (AsyncSinkProcessor, SinkProcessor, {}),
    (AsyncSource, Source, {}),
]

# parameters only the async method has: (class, method, parameter) -> why
ASYNC_ONLY_PARAMS: dict[tuple[type, str, str], str] = {
    (
        AsyncStreamProcessor,
        "run",
        "stop",
    ): "an asyncio.Event of the caller's loop; the blocking run() returns on max_steps or when caught up",
    (AsyncSinkProcessor, "run", "stop"): "as for AsyncStreamProcessor",
}


def _norm(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return re.sub(r"\bAsync", "", text)


def _members(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in dir(cls):
        if name.startswith("_") and name != "__init__":
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, classmethod | staticmethod):
            attr = attr.__func__
        if isinstance(attr, property):
            out[name] = "property"
        elif callable(attr):
            out[name] = attr
    return out


def _signature(cls: type, name: str, fn: Any) -> list[tuple[str, str, str, str]]:
    sig = inspect.signature(fn)
    params = [
        (p.name, p.kind.name, repr(p.default), _norm(p.annotation))
        for p in sig.parameters.values()
        if (cls, name, p.name) not in ASYNC_ONLY_PARAMS
    ]
    return [*params, ("->", "", "", _norm(sig.return_annotation))]


@pytest.mark.parametrize(("async_cls", "sync_cls", "async_only"), PAIRS, ids=[p[1].__name__ for p in PAIRS])
def test_twins_have_the_same_public_methods(async_cls: type, sync_cls: type, async_only: dict[str, str]) -> None:
    a, s = _members(async_cls), _members(sync_cls)
    methods_a = {n for n, f in a.items() if f != "property"} - set(async_only)
    methods_s = {n for n, f in s.items() if f != "property"}
    assert sorted(methods_a) == sorted(methods_s)
    for name in methods_s:
        assert _signature(async_cls, name, a[name]) == _signature(sync_cls, name, s[name]), (
            f"{sync_cls.__name__}.{name}"
        )
    # a property of the blocking twin reads an attribute (or property) of the async one
    source = inspect.getsource(async_cls) + "".join(inspect.getsource(b) for b in async_cls.__mro__[1:-1])
    for name in sorted(n for n, f in s.items() if f == "property"):
        assert name in a or re.search(rf"self\.{name}\b", source), f"{sync_cls.__name__}.{name}"


def test_no_public_client_signature_takes_arbitrary_keywords() -> None:
    for async_cls, sync_cls, _ in PAIRS:
        for cls in (async_cls, sync_cls):
            for name, fn in _members(cls).items():
                if fn == "property":
                    continue
                kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
                assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{cls.__name__}.{name}"
