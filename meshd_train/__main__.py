"""`python -m meshd_train`: train the built-in model (see `meshd_train.cli`)."""

from meshd_train.cli import main

main()
