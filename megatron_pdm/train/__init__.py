"""The RL loop: data, rewards, the trainer, checkpointing, logging (nothing imported here: import the modules)."""
