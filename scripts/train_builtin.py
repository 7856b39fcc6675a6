#!/usr/bin/env python3
"""Train the built-in model: `meshd_train.cli` (the `meshd_train` package, installed with meshd)."""

from meshd_train.cli import main

if __name__ == "__main__":
    main()
