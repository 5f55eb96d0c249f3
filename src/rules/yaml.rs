//! A small YAML tree that remembers the line of every node, so rule errors can
//! name file, line and key. Built from yaml-rust2's marked event stream;
//! anchors and aliases are resolved by copying the anchored node.

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
    /// Open collections with their anchor ids.
    stack: Vec<(Node, usize)>,
    /// For open maps: the pending key, if the next value completes a pair.
    keys: Vec<Option<Node>>,
    anchors: HashMap<usize, Node>,
    root: Option<Node>,
    error: Option<(usize, String)>,
}

impl Builder {
    fn push_value(&mut self, node: Node, anchor: usize) {
        if anchor > 0 {
            self.anchors.insert(anchor, node.clone());
        }
        let Some((parent, _)) = self.stack.last_mut() else {
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
        let line = mark.line();
        match ev {
            Event::Scalar(text, style, anchor, _tag) => {
                let plain = matches!(style, TScalarStyle::Plain);
                self.push_value(
                    Node {
                        line,
                        kind: Kind::Scalar { text, plain },
                    },
                    anchor,
                );
            }
            Event::SequenceStart(anchor, _) => {
                self.stack.push((
                    Node {
                        line,
                        kind: Kind::Seq(Vec::new()),
                    },
                    anchor,
                ));
                self.keys.push(None);
            }
            Event::MappingStart(anchor, _) => {
                self.stack.push((
                    Node {
                        line,
                        kind: Kind::Map(Vec::new()),
                    },
                    anchor,
                ));
                self.keys.push(None);
            }
            Event::SequenceEnd | Event::MappingEnd => {
                self.keys.pop();
                if let Some((node, anchor)) = self.stack.pop() {
                    self.push_value(node, anchor);
                }
            }
            Event::Alias(id) => match self.anchors.get(&id) {
                Some(node) => {
                    let mut node = node.clone();
                    node.line = line;
                    self.push_value(node, 0);
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
}
