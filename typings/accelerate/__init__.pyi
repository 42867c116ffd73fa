# the parts of accelerate z3kit_recipes.hf uses (accelerate ships no type information)
