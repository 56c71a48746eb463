"""Helpers the test modules share (``tests`` is on pytest's ``pythonpath``, so ``from helpers.txn import
Txn``). Test modules import from here, never from each other; fixtures live in ``conftest.py`` files."""
