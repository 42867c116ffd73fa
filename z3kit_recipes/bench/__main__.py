"""``python -m z3kit_recipes.bench``: see ``z3kit_recipes.bench``."""

from z3kit_recipes.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
