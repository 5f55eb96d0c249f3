//! Rendering of the deployment templates under `envoy/`: one template per
//! config file, filled in for each place it runs (tests, the local runner,
//! compose), so no second hand-kept copy can drift.

use std::collections::HashMap;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RenderError {
    #[error("template placeholder {{{{{0}}}}} has no value")]
    Missing(String),
    #[error("unterminated placeholder at byte {0}")]
    Unterminated(usize),
}

/// Replaces every `{{NAME}}` with its value; a placeholder without a value is
/// an error, so a template and its callers cannot silently disagree.
pub fn render(template: &str, vars: &HashMap<&str, String>) -> Result<String, RenderError> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find("}}").ok_or(RenderError::Unterminated(
            template.len() - rest.len() + start,
        ))?;
        let name = after[..end].trim();
        let value = vars
            .get(name)
            .ok_or_else(|| RenderError::Missing(name.to_string()))?;
        out.push_str(value);
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The `lb_endpoints` entries of the Envoy `leasehold` cluster, one per
/// (host, port), indented to sit under `lb_endpoints:`.
pub fn envoy_endpoints(targets: &[(String, u16)]) -> String {
    targets
        .iter()
        .map(|(host, port)| {
            format!(
                "              - endpoint:\n                  address:\n                    socket_address: {{ address: {host}, port_value: {port} }}\n"
            )
        })
        .collect::<String>()
        .trim_end()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_and_rejects_missing_values() {
        let vars = HashMap::from([("A", "1".to_string()), ("B", "two".to_string())]);
        assert_eq!(render("x {{A}} y {{ B }}", &vars), Ok("x 1 y two".into()));
        assert_eq!(
            render("{{C}}", &vars),
            Err(RenderError::Missing("C".into()))
        );
        assert_eq!(render("ok {{A", &vars), Err(RenderError::Unterminated(3)));
    }
}
