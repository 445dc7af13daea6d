//! A filter's CEL expression: compiled and checked at load, evaluated per notification over
//! `object`, `oldObject` and `type`. What the expression reads is taken from CEL's own
//! syntax tree, so that fields it never reads are not even parsed from the object's JSON.

use std::sync::Arc;

use cel::{IdedExpr, common::ast::Expr as Node, common::value::Val};

use super::cel_json::{Fields, Usage, null, to_val};
use crate::informer::{CachedObject, EventType};

/// The variables a filter sees.
pub const VARIABLES: [&str; 3] = ["object", "oldObject", "type"];

/// Errors of a filter's settings, found at load.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The expression does not parse.
    #[error("syntax error at line {line}, column {column}: {message}")]
    Syntax {
        /// 1-based line.
        line: isize,
        /// 1-based column.
        column: isize,
        /// What the parser said.
        message: String,
    },
    /// The expression names something that is neither a variable nor a function.
    #[error("unknown name `{name}`{at}: a filter sees {vars} and CEL's standard functions", vars = VARIABLES.join(", "))]
    UnknownName {
        /// The name.
        name: String,
        /// ` at line L, column C`, when known.
        at: String,
    },
    /// A `filter` reads `type` or `oldObject`: it decides which objects belong to the stream,
    /// which a change cannot.
    #[error(
        "`filter` decides which objects belong to the stream and sees only `object`, but reads \
         `{name}`{at}: put conditions on changes in `publish_if` (and `type != \"synced\"` is \
         `events: [added, updated, deleted]`)"
    )]
    ChangeInMembership {
        /// `type` or `oldObject`.
        name: String,
        /// ` at line L, column C`, when known.
        at: String,
    },
    /// The expression does not give a boolean.
    #[error("the expression must be a boolean, but gives a {0} value")]
    NotBoolean(String),
    /// An operator or function applied to types it does not take, whatever the object.
    #[error("type error: {0}")]
    Type(String),
    /// An `ignore_fields` entry is not a JSON pointer to a field.
    #[error("{0:?} is not a JSON pointer to a field (like \"/status\")")]
    Pointer(String),
}

/// A compiled filter expression.
pub struct Expr {
    program: cel::Program,
    env: Arc<cel::Env>,
    // What the expression reads of `object` and `oldObject`: fields not read are not even
    // parsed.
    object_fields: Usage,
    old_fields: Usage,
}

impl std::fmt::Debug for Expr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Expr").finish_non_exhaustive()
    }
}

impl Expr {
    /// Compiles `source`. A syntax error names its line and column; so does a reference to
    /// something that is neither a variable the filter sees nor a CEL function, and an
    /// expression that is not boolean (checked by evaluating it against a sample object, as
    /// CEL here is dynamically typed: errors that depend on the objects show at evaluation).
    pub fn compile(source: &str) -> Result<Self, Error> {
        let env = Arc::new(cel::Env::stdlib());
        let program = env
            .compile(source)
            .map_err(|errs| match errs.errors.first() {
                Some(e) => Error::Syntax {
                    line: e.pos.0,
                    column: e.pos.1,
                    message: e
                        .msg
                        .strip_prefix("Syntax error: ")
                        .unwrap_or(&e.msg)
                        .to_owned(),
                },
                None => Error::Syntax {
                    line: 0,
                    column: 0,
                    message: "cannot parse".into(),
                },
            })?;
        let root = program.expression();
        let expr = Self {
            object_fields: usage(root, "object"),
            old_fields: usage(root, "oldObject"),
            program,
            env,
        };
        expr.check()?;
        Ok(expr)
    }

    /// Compiles a membership expression (a resource's `filter`): like [`compile`](Self::compile),
    /// but it may read only `object`, since it says which objects belong to the stream, not
    /// which changes to publish.
    pub fn compile_membership(source: &str) -> Result<Self, Error> {
        let expr = Self::compile(source)?;
        for name in ["type", "oldObject"] {
            if mentions(expr.program.expression(), name) {
                let at = position_of(&expr.program, name)
                    .map(|(line, column)| format!(" at line {line}, column {column}"))
                    .unwrap_or_default();
                return Err(Error::ChangeInMembership {
                    name: name.to_owned(),
                    at,
                });
            }
        }
        Ok(expr)
    }

    /// Evaluates the expression against a sample object as each event type, and turns what
    /// cannot depend on the objects into an error: an undeclared reference, a wrong argument
    /// count, an operator or function applied to types it does not take (the sample's
    /// metadata has Kubernetes' types), or a result that is not a boolean.
    fn check(&self) -> Result<(), Error> {
        for ty in EventType::ALL {
            let old = matches!(ty, EventType::Updated | EventType::Synced).then_some(SAMPLE);
            let sample = |json| to_val(json, None).expect("a valid sample");
            match self.run(sample(SAMPLE), old.map_or_else(null, sample), ty) {
                Ok(cel::Value::Bool(_)) => {}
                Ok(other) => {
                    return Err(Error::NotBoolean(format!("{:?}", other.type_of())));
                }
                Err(cel::ExecutionError::UndeclaredReference(name)) => {
                    let at = position_of(&self.program, &name)
                        .map(|(line, column)| format!(" at line {line}, column {column}"))
                        .unwrap_or_default();
                    return Err(Error::UnknownName {
                        name: name.to_string(),
                        at,
                    });
                }
                Err(
                    e @ (cel::ExecutionError::InvalidArgumentCount { .. }
                    | cel::ExecutionError::NoSuchOverload(_)
                    | cel::ExecutionError::UnsupportedBinaryOperator(..)
                    | cel::ExecutionError::ValuesNotComparable(..)),
                ) if ty == EventType::Updated => {
                    return Err(Error::Type(e.to_string()));
                }
                Err(_) => {} // depends on the objects (a missing key, say)
            }
        }
        Ok(())
    }

    /// Whether the notification about `object` (and `old`) of type `ty` passes. The objects'
    /// JSON is read straight into CEL values that borrow its strings, skipping the fields the
    /// expression does not read (see [`usage`]).
    pub fn eval<'a>(
        &self,
        object: &'a CachedObject,
        old: Option<&'a CachedObject>,
        ty: EventType,
    ) -> Result<bool, String> {
        let read = |usage: &Usage, obj: &'a CachedObject| match usage {
            Usage::Unused => Ok(null()),
            Usage::Fields(keep) => to_val(obj.json().get(), Some(keep)),
            Usage::Whole => to_val(obj.json().get(), None),
        };
        let object = read(&self.object_fields, object)?;
        let old = match old {
            Some(old) => read(&self.old_fields, old)?,
            None => null(),
        };
        match self.run(object, old, ty) {
            Ok(cel::Value::Bool(b)) => Ok(b),
            Ok(other) => Err(format!(
                "the filter gave a {:?} value, not a boolean",
                other.type_of()
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    fn run<'v>(
        &self,
        object: Box<dyn Val + 'v>,
        old: Box<dyn Val + 'v>,
        ty: EventType,
    ) -> Result<cel::Value, cel::ExecutionError> {
        let mut ctx = cel::Context::with_env(self.env.clone());
        ctx.add_variable_as_val("object", object);
        ctx.add_variable_as_val("oldObject", old);
        ctx.add_variable_from_value("type", ty.as_str());
        self.program.execute(&ctx)
    }
}

/// What the expression rooted at `root` reads of the variable `var`, from CEL's syntax tree
/// (macros expanded): when every use of `var` is a chain of field selections
/// (`object.metadata.labels`), the fields along those chains, each chain's last field whole;
/// anything else (`size(object)`, `object["spec"]`) reads the whole variable. A chain's result
/// may be used in any way (indexed, compared, iterated): it is kept whole.
pub(super) fn usage(root: &IdedExpr, var: &str) -> Usage {
    fn walk(e: &IdedExpr, var: &str, fields: &mut Fields) -> bool {
        fn all<'e>(
            es: impl IntoIterator<Item = &'e IdedExpr>,
            var: &str,
            fields: &mut Fields,
        ) -> bool {
            es.into_iter().all(|e| walk(e, var, fields))
        }
        match &e.expr {
            Node::Select(s) => match chain(e, var) {
                Some(path) => {
                    read(fields, &path);
                    true
                }
                None => walk(&s.operand, var, fields),
            },
            Node::Ident(name) => !is(name, var),
            Node::Call(c) => all(c.target.iter().map(|t| &**t).chain(&c.args), var, fields),
            Node::List(l) => all(&l.elements, var, fields),
            Node::Map(m) => m.entries.iter().all(|entry| match &entry.expr {
                cel::common::ast::EntryExpr::MapEntry(m) => {
                    walk(&m.key, var, fields) && walk(&m.value, var, fields)
                }
                cel::common::ast::EntryExpr::StructField(f) => walk(&f.value, var, fields),
            }),
            Node::Struct(s) => s.entries.iter().all(|entry| match &entry.expr {
                cel::common::ast::EntryExpr::MapEntry(m) => {
                    walk(&m.key, var, fields) && walk(&m.value, var, fields)
                }
                cel::common::ast::EntryExpr::StructField(f) => walk(&f.value, var, fields),
            }),
            Node::Comprehension(c) => {
                // A macro variable of the same name shadows it: read everything, simply.
                let shadows =
                    c.iter_var == var || c.accu_var == var || c.iter_var2.as_deref() == Some(var);
                !shadows
                    && all(
                        [
                            &c.iter_range,
                            &c.accu_init,
                            &c.loop_cond,
                            &c.loop_step,
                            &c.result,
                        ],
                        var,
                        fields,
                    )
            }
            Node::Literal(_) | Node::Unspecified => true,
        }
    }
    /// The fields `e` selects of `var` (outermost last), if `e` is a chain of selections
    /// rooted at `var`.
    fn chain<'e>(mut e: &'e IdedExpr, var: &str) -> Option<Vec<&'e str>> {
        let mut path = Vec::new();
        loop {
            match &e.expr {
                Node::Select(s) => {
                    path.push(s.field.as_str());
                    e = &s.operand;
                }
                Node::Ident(name) if is(name, var) => {
                    path.reverse();
                    return Some(path);
                }
                _ => return None,
            }
        }
    }
    /// Records that the field at `path` is read whole (and the fields on the way to it, in
    /// part), unless a field on the way is read whole already.
    fn read(fields: &mut Fields, path: &[&str]) {
        let Some((first, rest)) = path.split_first() else {
            return;
        };
        if rest.is_empty() {
            fields.insert((*first).to_owned(), Usage::Whole);
            return;
        }
        let at = fields
            .entry((*first).to_owned())
            .or_insert_with(|| Usage::Fields(Fields::new()));
        if let Usage::Fields(below) = at {
            read(below, rest);
        }
    }
    let mut fields = Fields::new();
    if !walk(root, var, &mut fields) {
        Usage::Whole
    } else if fields.is_empty() && !mentions(root, var) {
        Usage::Unused
    } else {
        Usage::Fields(fields)
    }
}

/// Whether the identifier `name` names the variable `var`: cel keeps a leading dot
/// (`.object`, the root-scoped name) in the identifier and resolves it to the same variable.
fn is(name: &str, var: &str) -> bool {
    name.strip_prefix('.').unwrap_or(name) == var
}

/// Whether `var` appears anywhere in the tree (as a variable or a selected operand).
fn mentions(root: &IdedExpr, var: &str) -> bool {
    let mut found = false;
    visit(root, &mut |e| {
        found |= matches!(&e.expr, Node::Ident(n) if is(n, var));
    });
    found
}

/// The 1-based line and column of the first use of `name` (a variable or a function) in the
/// program's source, from the positions CEL's parser recorded.
fn position_of(program: &cel::Program, name: &str) -> Option<(usize, usize)> {
    let mut first: Option<usize> = None;
    let info = program.source_info();
    let source = info.source.as_str();
    visit(program.expression(), &mut |e| {
        let Some((start, _)) = info.offset_for(e.id) else {
            return;
        };
        let start = start as usize;
        let at = match &e.expr {
            Node::Ident(n) if is(n, name) => Some(start),
            // cel places a call at its `(`; the function's name stands right before it.
            Node::Call(c) if c.func_name == name => source
                .get(..start)
                .filter(|before| before.trim_end().ends_with(name))
                .map(|before| before.trim_end().len() - name.len()),
            _ => None,
        };
        if let Some(at) = at {
            first = Some(first.map_or(at, |f| f.min(at)));
        }
    });
    let before = source.get(..first?)?;
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    Some((line, column))
}

/// Calls `f` on every node of the tree, parents first.
fn visit(e: &IdedExpr, f: &mut dyn FnMut(&IdedExpr)) {
    f(e);
    let entry = |entry: &cel::common::ast::EntryExpr, f: &mut dyn FnMut(&IdedExpr)| match entry {
        cel::common::ast::EntryExpr::MapEntry(m) => {
            visit(&m.key, f);
            visit(&m.value, f);
        }
        cel::common::ast::EntryExpr::StructField(s) => visit(&s.value, f),
    };
    match &e.expr {
        Node::Select(s) => visit(&s.operand, f),
        Node::Call(c) => {
            c.target.iter().for_each(|t| visit(t, f));
            c.args.iter().for_each(|a| visit(a, f));
        }
        Node::List(l) => l.elements.iter().for_each(|x| visit(x, f)),
        Node::Map(m) => m.entries.iter().for_each(|x| entry(&x.expr, f)),
        Node::Struct(s) => s.entries.iter().for_each(|x| entry(&x.expr, f)),
        Node::Comprehension(c) => {
            for x in [
                &c.iter_range,
                &c.accu_init,
                &c.loop_cond,
                &c.loop_step,
                &c.result,
            ] {
                visit(x, f);
            }
        }
        Node::Ident(_) | Node::Literal(_) | Node::Unspecified => {}
    }
}

/// What a filter is checked against at load: metadata with Kubernetes' types.
const SAMPLE: &str = r#"{"apiVersion":"v1","kind":"Sample","metadata":{"name":"sample",
    "namespace":"default","uid":"00000000-0000-0000-0000-000000000000","resourceVersion":"1",
    "generation":1,"creationTimestamp":"2026-01-01T00:00:00Z","labels":{},"annotations":{}}}"#;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::filter::tests::object;

    #[test]
    fn syntax_errors_name_line_and_column() {
        let err = Expr::compile("object.metadata.name ==")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("syntax error at line 1, column"), "{err}");
        let err = Expr::compile("object.metadata.name == 'a' &&\n  ) ")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("syntax error at line 2"), "{err}");
    }

    #[test]
    fn unknown_names_and_non_boolean_expressions_are_errors() {
        let err = Expr::compile("obj.metadata.name == 'a'")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown name `obj` at line 1, column 1"),
            "{err}"
        );
        let err = Expr::compile("type == 'added' && nosuch(object)")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown name `nosuch`"), "{err}");
        let err = Expr::compile("type == 'added' &&\n  nosuch(object)")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`nosuch` at line 2, column 3"), "{err}");
        let err = Expr::compile("object.metadata.name.nosuch()")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`nosuch` at line 1, column"), "{err}");
        let err = Expr::compile("object.metadata.name")
            .unwrap_err()
            .to_string();
        assert!(err.contains("must be a boolean"), "{err}");
        let err = Expr::compile("object.metadata.generation + 'x' == 1")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("type error"), "{err}");
        // Depends on the objects: fine at compile time.
        Expr::compile("object.spec.replicas > 2").unwrap();
        Expr::compile(r#"object.metadata.labels["team"] == "shop" && type != "synced""#).unwrap();
        Expr::compile("has(object.metadata.labels.team) && object.metadata.name.startsWith('a')")
            .unwrap();
        Expr::compile("type == 'updated' && object.data != oldObject.data").unwrap();
    }

    #[test]
    fn evaluation_sees_object_old_object_and_type() {
        let e = Expr::compile(
            r#"object.metadata.labels["team"] == "shop" && (type != "updated" || oldObject.status.phase != object.status.phase)"#,
        )
        .unwrap();
        let a = object("a", "1", "shop", "Pending");
        let b = object("a", "2", "shop", "Running");
        let c = object("a", "3", "web", "Running");
        assert_eq!(e.eval(&a, None, EventType::Added), Ok(true));
        assert_eq!(e.eval(&b, Some(&a), EventType::Updated), Ok(true));
        assert_eq!(e.eval(&b, Some(&b), EventType::Updated), Ok(false));
        assert_eq!(e.eval(&c, None, EventType::Added), Ok(false));
        let missing = Expr::compile("object.spec.replicas > 2").unwrap();
        let err = missing
            .eval(&a, None, EventType::Added)
            .unwrap_err()
            .to_string();
        assert!(err.contains("spec"), "{err}");
    }

    #[test]
    fn only_the_fields_read_are_parsed() {
        // `fields(&["metadata.labels"])`: the fields along those paths, each path's last whole.
        let fields = |paths: &[&str]| {
            let mut top = Fields::new();
            for path in paths {
                let mut at = &mut top;
                let steps: Vec<&str> = path.split('.').collect();
                for (i, step) in steps.iter().enumerate() {
                    if i + 1 == steps.len() {
                        at.insert(step.to_string(), Usage::Whole);
                    } else {
                        let next = at
                            .entry(step.to_string())
                            .or_insert_with(|| Usage::Fields(Fields::new()));
                        let Usage::Fields(next) = next else {
                            unreachable!()
                        };
                        at = next;
                    }
                }
            }
            Usage::Fields(top)
        };
        let fields_read = |source: &str, var: &str| {
            usage(
                cel::Env::stdlib().compile(source).unwrap().expression(),
                var,
            )
        };
        assert_eq!(
            fields_read(
                "object.metadata.name == 'a' && object . spec.x > oldObject.status.y",
                "object"
            ),
            fields(&["metadata.name", "spec.x"])
        );
        assert_eq!(
            fields_read("oldObject.status.y == 1", "oldObject"),
            fields(&["status.y"])
        );
        assert_eq!(
            fields_read("oldObject.status.y == 1", "object"),
            Usage::Unused
        );
        assert_eq!(fields_read("size(object) > 1", "object"), Usage::Whole);
        assert_eq!(fields_read("object['spec'].x == 1", "object"), Usage::Whole);
        // The syntax tree tells a string from a name (the old text scan could not).
        assert_eq!(
            fields_read("object.spec.x == 'the object'", "object"),
            fields(&["spec.x"])
        );
        // What a chain ends at is read whole, however it is used.
        assert_eq!(
            fields_read("object.metadata.labels.exists(k, k == 'a')", "object"),
            fields(&["metadata.labels"])
        );
        assert_eq!(
            fields_read(
                "object.metadata.labels['app'] == 'x' && size(object.metadata) > 1",
                "object"
            ),
            fields(&["metadata"])
        );
        assert_eq!(
            fields_read(
                "object.spec.containers[0].image == 'x' && has(object.status.phase)",
                "object"
            ),
            fields(&["spec.containers", "status.phase"])
        );
        assert_eq!(
            fields_read("[1].exists(object, object > 0)", "object"),
            Usage::Whole
        );
        // `.object` is the same variable, scoped to the root.
        assert_eq!(
            fields_read(
                "object.metadata.name == 'a' && .object.spec.x == 1",
                "object"
            ),
            fields(&["metadata.name", "spec.x"])
        );
        // Pruned or not, the verdict is the same: passes, fails, and errors alike.
        let (o, old) = (object("a", "2", "shop", "x"), object("a", "1", "shop", "y"));
        for e in [
            "object.status.phase == 'x'",
            "object.status.phase == 'y'",
            "has(object.data) && object.metadata.labels.team == 'shop'",
            "has(object.metadata.annotations)",
            "has(object.status.phase) && !has(object.status.reason)",
            "object.metadata.labels.nope == 'x'",
            "object.spec.x == 1",
            "object.data.k.x == 'v'",
            "object.metadata.labels == {'team': 'shop'}",
            "size(object.metadata.labels) == 1 && 'team' in object.metadata.labels",
            "object.metadata.all(k, k != 'generation')",
            "object.metadata.labels.team.startsWith('sh') && object.data.k == 'v'",
            "oldObject.status.phase != object.status.phase",
            "oldObject.metadata.labels.team == object.metadata.labels.team",
            "object.metadata.namespace + '/' + object.metadata.name == 'ns/a'",
        ] {
            let pruned = Expr::compile(e).unwrap();
            let mut whole = Expr::compile(e).unwrap();
            (whole.object_fields, whole.old_fields) = (Usage::Whole, Usage::Whole);
            assert_ne!(pruned.object_fields, Usage::Whole, "{e}");
            assert_eq!(
                pruned.eval(&o, Some(&old), EventType::Updated),
                whole.eval(&o, Some(&old), EventType::Updated),
                "{e}"
            );
        }
    }
}
