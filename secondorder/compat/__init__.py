"""Drop-in interfaces for users of other LM libraries."""
