"""``{http-reference}``: the admin API's endpoints, generated from the OpenAPI document the
API serves (:func:`admin_api.openapi.build`, the same function behind
``/api/openapi.json``), so each path, parameter, body field and status shown is the one
the API documents; a test checks that every route is documented and that real responses
match it.

``{http-roles}``: who may call each operation, from the same declarations the API
authorizes with (:mod:`admin_api.operations`), for the security guide.
"""

from __future__ import annotations

from docnodes import paragraph, section, table
from docutils import nodes
from sphinx.util.docutils import SphinxDirective

METHODS = ("get", "post", "put", "patch", "delete")


def _type(schema: dict) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[1]
    if "anyOf" in schema:  # a nullable object: [its schema, null]
        return " or ".join(_type(choice) for choice in schema["anyOf"])
    kind = schema.get("type", "")
    if isinstance(kind, list):
        kind = " or ".join(kind)
    if kind == "array" and "items" in schema:
        kind = f"array of {_type(schema['items'])}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        kind = f"object of {_type(schema['additionalProperties'])}"
    if "enum" in schema:
        kind += f" ({', '.join(str(v) for v in schema['enum'])})"
    if "format" in schema:
        kind += f", {schema['format']}"
    bounds = [
        f"{key} {schema[key]}" for key in ("minimum", "maximum", "maxLength", "default")
        if key in schema
    ]  # fmt: skip
    if bounds:
        kind += f"; {', '.join(bounds)}"
    return kind


def _fields(schema: dict, components: dict) -> list[list[str]]:
    if "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[1]]
    required = set(schema.get("required", ()))
    return [
        [f"`{name}`", _type(spec), "yes" if name in required else "", spec.get("description", "")]
        for name, spec in schema.get("properties", {}).items()
    ]


class HttpReference(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        from admin_api.openapi import build

        document = build()
        components = document["components"]["schemas"]
        result: list[nodes.Node] = []
        for path, operations in document["paths"].items():
            for method in METHODS:
                if method not in operations:
                    continue
                result.append(self._operation(method, path, operations[method], components))
        schemas = section(self.state.document, "Schemas")
        for name, schema in components.items():
            part = section(self.state.document, name)
            if schema.get("description"):
                part += paragraph(schema["description"])
            rows = _fields(schema, components)
            if rows:
                part += table(["field", "type", "required", "meaning"], rows, [22, 26, 10, 42])
            schemas += part
        result.append(schemas)
        return result

    def _operation(self, method: str, path: str, op: dict, components: dict) -> nodes.section:
        part = section(self.state.document, f"{method.upper()} {path}", code=True)
        part += paragraph(op.get("summary", ""))
        for text in op.get("description", "").split("\n\n"):
            if text.strip():
                part += paragraph(text.strip())
        if op.get("security") == [] and "credential" not in op.get("summary", ""):
            part += paragraph("No credentials needed.")
        parameters = [
            [f"`{p['name']}`", p["in"], _type(p["schema"]), "yes" if p.get("required") else "",
             p.get("description", "")]
            for p in op.get("parameters", ())
        ]  # fmt: skip
        if parameters:
            part += nodes.rubric(text="Parameters")
            part += table(["name", "in", "type", "required", "meaning"], parameters,
                          [18, 8, 26, 10, 38])  # fmt: skip
        body = op.get("requestBody")
        if body:
            schema = body["content"]["application/json"]["schema"]
            part += nodes.rubric(text="JSON body")
            if body.get("description"):
                part += paragraph(body["description"])
            rows = _fields(schema, components)
            if rows:
                part += table(["field", "type", "required", "meaning"], rows, [22, 26, 10, 42])
        part += nodes.rubric(text="Responses")
        responses = nodes.bullet_list()
        for status, response in op.get("responses", {}).items():
            item = nodes.list_item()
            content = response.get("content", {}).get("application/json", {}).get("schema")
            text = f"`{status}`: {response.get('description', '')}"
            if content and "$ref" in content:
                text += f" ({_type(content)})"
            item += paragraph(text)
            responses += item
        part += responses
        return part


class HttpRoles(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        from admin_api.app import API, PAGES
        from admin_api.openapi import roles
        from admin_api.operations import operations, routes

        rows = [
            [f"`{method} {' '.join(routes(resource))}`", roles(op)]
            for resource in (*API, *PAGES)
            for method, op in operations(resource).items()
        ]
        return [table(["operation", "who may call it"], rows, [55, 45])]


def setup(app):
    app.add_directive("http-reference", HttpReference)
    app.add_directive("http-roles", HttpRoles)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
