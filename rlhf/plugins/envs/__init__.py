"""Built-in environments: single-turn, tool-integrated reasoning (python sandbox), env_func routing."""
