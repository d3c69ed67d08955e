import types


class DatabaseWrapper:
    vendor = "postgresql"
    Database = types.ModuleType("psycopg2")
