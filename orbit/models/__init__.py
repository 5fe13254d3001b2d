"""Models built or brought offline: a tiny random-init model (tiny.py), its supervised warm start
(warmstart.py), and a GGUF file or checkpoint imported as a plain checkpoint (importer.py)."""
