"""Built-in reward shapings (``register_reward_shapings``): ``overlong`` and ``truncation``."""
