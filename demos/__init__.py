"""Demo programs, run as ``python -m demos.<name>`` from a checkout (``make demo`` runs
``demos.service``). Not installed with the runtime packages."""
