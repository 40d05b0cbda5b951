"""Offline data preparation (`megalite prepare-data`): raw files in, prepared shards out. No
training rank imports it (tests/test_imports.py); a run starts it as a process of its own."""
