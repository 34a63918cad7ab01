"""What the tests share: plain functions, classes and constants, by concept, imported as `from helpers.X import ...`
(pytest puts tests/ on sys.path). Fixtures stay in conftest.py; no test module imports another."""
