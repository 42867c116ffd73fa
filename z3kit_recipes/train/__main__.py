"""``python -m z3kit_recipes.train``: see ``z3kit_recipes.train``."""

from z3kit_recipes.train.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
