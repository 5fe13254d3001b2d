"""Not a package of Orbit: this directory is put on PYTHONPATH (see ../__init__.py). The file is
here so that a non-editable install ships the directory."""
