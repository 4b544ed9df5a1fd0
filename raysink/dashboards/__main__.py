"""``python -m raysink.dashboards``: regenerate ``raysink.json`` and ``alerts.yaml``."""

from raysink.dashboards import write_files

for written in write_files():
    print(f"wrote {written}")
