#!/usr/bin/env python3
"""Evaluate the built-in model: `meshd_train.evaluate` (the `meshd_train` package, installed with meshd)."""

from meshd_train.evaluate import main

if __name__ == "__main__":
    main()
