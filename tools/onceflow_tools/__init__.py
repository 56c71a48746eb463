"""onceflow's development tools: benchmarks (``bench``), the chaos harness (``chaos``) and the
deterministic simulator (``sim``), shipped apart from onceflow (the ``onceflow-tools`` distribution
in ``tools/``; ``scripts/setup.sh dev`` or ``pip install -e tools`` installs it).

``onceflow bench|chaos|sim`` run them: onceflow's command adds their sub-commands from
:mod:`onceflow_tools.cli` when this package is installed. They use onceflow through its public
modules and :mod:`onceflow.testing` (docs/architecture.md).
"""

__all__: list[str] = []
