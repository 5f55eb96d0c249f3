//! A small YAML tree that remembers the line of every node, so rule errors can
//! name file, line and key. Built from yaml-rust2's marked event stream;
//! anchors and aliases are resolved by copying the anchored node.
//!
//! Bounded, because a rules file may arrive by hot reload from anywhere
//! the rules directory is writable: at most [`MAX_NODES`] nodes after
//! alias expansion (an alias bomb stops there, before it is copied) and
//! [`MAX_DEPTH`] levels of nesting (the tree is walked and dropped
//! recursively, so depth is stack). Past either, the file is an error and
//! a reload keeps the old rules.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

#[derive(Clone, Debug)]
pub struct Node {
    /// 1-based line where the node starts.
    pub line: usize,
    pub kind: Kind,
}

#[derive(Clone, Debug)]
pub enum Kind {
    /// A scalar; `plain` is false for quoted or block scalars, which are never
    /// null, booleans or numbers.
    Scalar {
        text: String,
        plain: bool,
    },
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

impl Node {
    pub fn is_null(&self) -> bool {
        matches!(&self.kind, Kind::Scalar { text, plain: true } if matches!(text.as_str(), "" | "~" | "null" | "Null" | "NULL"))
    }

    /// A short description of the node's type for error messages.
    pub fn type_name(&self) -> &'static str {
        match &self.kind {
            _ if self.is_null() => "null",
            Kind::Scalar { .. } => "scalar",
            Kind::Seq(_) => "list",
            Kind::Map(_) => "map",
        }
    }
}

/// Most nodes in one file, aliases expanded. Real rule files have a few
/// thousand.
pub const MAX_NODES: usize = 200_000;
/// Deepest nesting of lists and maps.
pub const MAX_DEPTH: usize = 64;

/// Parses one YAML document. An empty stream yields `None`.
pub fn parse(source: &str) -> Result<Option<Node>, (usize, String)> {
    let mut builder = Builder::default();
    let mut parser = Parser::new_from_str(source);
    parser
        .load(&mut builder, false)
        .map_err(|e| (e.marker().line(), e.info().to_string()))?;
    if let Some(err) = builder.error {
        return Err(err);
    }
    Ok(builder.root)
}

#[derive(Default)]
struct Builder {
    /// Open collections with their anchor ids and the node count when
    /// they opened.
    stack: Vec<(Node, usize, usize)>,
    /// For open maps: the pending key, if the next value completes a pair.
    keys: Vec<Option<Node>>,
    /// Anchored nodes with their sizes in nodes.
    anchors: HashMap<usize, (Node, usize)>,
    root: Option<Node>,
    /// Nodes built so far, aliases counted at their expanded size.
    nodes: usize,
    error: Option<(usize, String)>,
}

impl Builder {
    /// Counts `n` more nodes; false (with the error set) past the bound.
    fn grow(&mut self, n: usize, line: usize) -> bool {
        self.nodes = self.nodes.saturating_add(n);
        if self.nodes > MAX_NODES {
            self.error.get_or_insert((
                line,
                format!("more than {MAX_NODES} YAML nodes (aliases expanded); the file is refused"),
            ));
            return false;
        }
        true
    }

    fn push_value(&mut self, node: Node, anchor: usize, size: usize) {
        if anchor > 0 {
            self.anchors.insert(anchor, (node.clone(), size));
        }
        let Some((parent, _, _)) = self.stack.last_mut() else {
            if self.root.is_none() {
                self.root = Some(node);
            }
            return;
        };
        match &mut parent.kind {
            Kind::Seq(items) => items.push(node),
            Kind::Map(pairs) => {
                let pending = self.keys.last_mut().and_then(Option::take);
                match pending {
                    Some(key) => pairs.push((key, node)),
                    None => {
                        if let Some(slot) = self.keys.last_mut() {
                            *slot = Some(node);
                        }
                    }
                }
            }
            Kind::Scalar { .. } => {}
        }
    }
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        // After an error nothing more is built: the file is refused anyway.
        if self.error.is_some() {
            return;
        }
        let line = mark.line();
        match ev {
            Event::Scalar(text, style, anchor, _tag) => {
                if !self.grow(1, line) {
                    return;
                }
                let plain = matches!(style, TScalarStyle::Plain);
                self.push_value(
                    Node {
                        line,
                        kind: Kind::Scalar { text, plain },
                    },
                    anchor,
                    1,
                );
            }
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                if !self.grow(1, line) {
                    return;
                }
                if self.stack.len() >= MAX_DEPTH {
                    self.error.get_or_insert((
                        line,
                        format!("nested deeper than {MAX_DEPTH} levels; the file is refused"),
                    ));
                    return;
                }
                let kind = if matches!(ev, Event::SequenceStart(..)) {
                    Kind::Seq(Vec::new())
                } else {
                    Kind::Map(Vec::new())
                };
                self.stack
                    .push((Node { line, kind }, anchor, self.nodes - 1));
                self.keys.push(None);
            }
            Event::SequenceEnd | Event::MappingEnd => {
                self.keys.pop();
                if let Some((node, anchor, opened_at)) = self.stack.pop() {
                    let size = self.nodes - opened_at;
                    self.push_value(node, anchor, size);
                }
            }
            Event::Alias(id) => match self.anchors.get(&id) {
                Some((_, size)) => {
                    let size = *size;
                    // Counted before it is copied, so a bomb never is.
                    if !self.grow(size, line) {
                        return;
                    }
                    if let Some((node, _)) = self.anchors.get(&id) {
                        let mut node = node.clone();
                        node.line = line;
                        self.push_value(node, 0, size);
                    }
                }
                None => {
                    self.error
                        .get_or_insert((line, format!("unknown alias {id}")));
                }
            },
            Event::Nothing
            | Event::StreamStart
            | Event::StreamEnd
            | Event::DocumentStart
            | Event::DocumentEnd => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_lines_and_structure() {
        let doc = "domain: d\ndescriptors:\n  - key: a\n    value: \"1\"\n";
        let root = parse(doc).ok().flatten().expect("doc");
        let Kind::Map(pairs) = &root.kind else {
            panic!("map")
        };
        assert_eq!(pairs.len(), 2);
        let Kind::Seq(items) = &pairs[1].1.kind else {
            panic!("seq")
        };
        assert_eq!(items[0].line, 3);
        let Kind::Map(inner) = &items[0].kind else {
            panic!("map")
        };
        assert_eq!(inner[1].0.line, 4);
        assert!(matches!(&inner[1].1.kind, Kind::Scalar { text, plain: false } if text == "1"));
    }

    #[test]
    fn resolves_aliases_and_reports_syntax_errors() {
        let doc = "a: &x {k: v}\nb: *x\n";
        let root = parse(doc).ok().flatten().expect("doc");
        let Kind::Map(pairs) = &root.kind else {
            panic!("map")
        };
        assert!(matches!(pairs[1].1.kind, Kind::Map(_)));
        let err = parse("a: [1, 2\nb: c").expect_err("error");
        assert!(err.0 >= 1);
        assert!(parse("").ok().flatten().is_none());
    }

    #[test]
    fn alias_bombs_and_deep_nesting_are_refused_before_they_cost() {
        // Ten levels of ten aliases each: 10^10 nodes if expanded.
        let mut doc = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..10 {
            let refs = vec![format!("*a{}", i - 1); 10].join(", ");
            doc.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
        }
        let err = parse(&doc).expect_err("a bomb");
        assert!(err.1.contains("YAML nodes"), "{err:?}");
        assert!(err.0 >= 5, "the line where the bound was crossed: {err:?}");
        // A few levels of aliases are fine.
        let small = "a: &a [x, y]\nb: &b [*a, *a]\nc: [*b, *b]\n";
        assert!(parse(small).is_ok());

        let deep = format!(
            "{}x{}",
            "[".repeat(MAX_DEPTH + 1),
            "]".repeat(MAX_DEPTH + 1)
        );
        let err = parse(&deep).expect_err("too deep");
        assert!(err.1.contains("nested deeper"), "{err:?}");
        let ok = format!("{}x{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(parse(&ok).is_ok());
    }
}
