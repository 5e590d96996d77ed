"""Per-framework lowerings of the spec. Each sub-package knows exactly one framework and nothing of
comparison; `python -m wrappers` is the only door the harness uses."""
