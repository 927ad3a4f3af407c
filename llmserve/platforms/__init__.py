"""What the machine can do: CPU features and the dtype choice that follows."""
