"""Database helpers below every layer: batch iteration and the SQL that differs per backend."""
