#!/usr/bin/env python3
"""Blend two exported built-in checkpoints: `meshd_train.mix` (the `meshd_train` package, installed with meshd)."""

from meshd_train.mix import main

if __name__ == "__main__":
    main()
